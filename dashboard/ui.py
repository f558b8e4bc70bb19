"""Helpers every page uses: the selected run, guarded sections, controls that keep a valid value,
and plotting with one configuration."""
from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

import streamlit as st

from sparsecal.dashboard.data import Missing
from sparsecal.formats.errors import UserError

RUN_KEY = "run"
PLOT_CONFIG = {"displaylogo": False, "modeBarButtonsToRemove": ["lasso2d", "select2d"]}


def current_run() -> Path:
    """The run chosen in the sidebar (app.py puts the selector there)."""
    return Path(st.session_state[RUN_KEY])


def header(title: str, blurb: str) -> Path:
    """Page title, a one-line explanation and the run it shows; returns the run."""
    root = current_run()
    st.title(title)
    st.caption(f"{blurb}  \nRun: `{root}`")
    return root


@contextmanager
def section():
    """Show a missing file as an info box that names the command making it, and any other
    problem with a file (unreadable, old schema, lacking columns) as an error box: never a
    traceback. Code after the failing line in the block is skipped."""
    try:
        yield
    except Missing as e:
        st.info(str(e), icon=":material/info:")
    except UserError as e:
        st.error(str(e), icon=":material/error:")


def choose(label: str, options, key: str, default=None, fmt=str, where=None, help=None):
    """A selectbox whose stored value is dropped when it is no longer an option (another run was
    chosen), falling back to ``default`` (or the first option)."""
    options = list(options)
    if key in st.session_state and st.session_state[key] not in options:
        del st.session_state[key]
    index = options.index(default) if default in options else 0
    return (where or st).selectbox(label, options, index=index, key=key, format_func=fmt, help=help)


def choose_many(label: str, options, key: str, default=None, fmt=str, where=None):
    """A multiselect that keeps only values still offered."""
    options = list(options)
    if key in st.session_state:
        st.session_state[key] = [v for v in st.session_state[key] if v in options]
    dflt = [v for v in (default if default is not None else options) if v in options]
    if key in st.session_state:
        return (where or st).multiselect(label, options, key=key, format_func=fmt)
    return (where or st).multiselect(label, options, default=dflt, key=key, format_func=fmt)


def slider_choice(label: str, options, key: str, default, fmt=str, where=None, help=None):
    """A select_slider over ``options`` that resets to ``default`` when its value left the list."""
    options = list(options)
    if key in st.session_state and st.session_state[key] not in options:
        del st.session_state[key]
    if key in st.session_state:
        return (where or st).select_slider(label, options, key=key, format_func=fmt, help=help)
    return (where or st).select_slider(label, options, value=default, key=key, format_func=fmt, help=help)


def plot(fig, key: str) -> None:
    st.plotly_chart(fig, key=key, config=PLOT_CONFIG)


def fmt_len(n) -> str:
    return f"{int(n):,} tokens"
