"""The dashboard's entry script: ``streamlit run app.py -- RUN [RUN ...]`` (what
``sparsecal dashboard`` runs). Runs come from $SPARSECAL_RUNS when set (os.pathsep-separated; the
tests use it), else from the script arguments; a directory without manifest.json stands for the
runs inside it. The sidebar picks the run, st.navigation the page; each page is a file next to
this one (page_*.py) so that AppTest can switch to it.
"""
from __future__ import annotations

import runpy
import sys
from pathlib import Path

import streamlit as st

from sparsecal.dashboard import data
from sparsecal.dashboard.ui import RUN_KEY

PAGES = (
    ("page_overview.py", "Overview", ":material/summarize:", "overview"),
    ("page_density.py", "Density", ":material/grid_on:", "density"),
    ("page_blasst.py", "BLASST", ":material/speed:", "blasst"),
    ("page_stabilization.py", "Stabilization", ":material/trending_flat:", "stabilization"),
    ("page_tiles.py", "Tiles", ":material/apps:", "tiles"),
    ("page_curves.py", "Accuracy-speedup", ":material/show_chart:", "accuracy-speedup"),
    ("page_export.py", "Export", ":material/download:", "export"),
)


def _run_label(path: str) -> str:
    try:
        man = data.manifest(path)
        return f"{path.rstrip('/').split('/')[-1]}  ({man['model']['id'].split(':')[-1]}, {len(data.samples(path))} samples)"
    except Exception:  # noqa: BLE001 - the label must not fail; the pages say what is wrong
        return path.rstrip("/").split("/")[-1]


def main() -> None:
    st.set_page_config(page_title="sparsecal dashboard", page_icon=":material/grid_view:", layout="wide")
    runs = [str(p) for p in data.run_paths(sys.argv[1:])]
    if not runs:
        st.error("No run given: start the dashboard with `sparsecal dashboard RUN [RUN ...]`.")
        st.stop()
    if st.session_state.get(RUN_KEY) not in runs:
        st.session_state[RUN_KEY] = runs[0]
    st.sidebar.selectbox("Run", runs, key=RUN_KEY, format_func=_run_label,
                         help="Runs given on the command line; each page shows the chosen one.")
    pages = [st.Page(f, title=t, icon=i, url_path=u if n else "home", default=n == 0)
             for n, (f, t, i, u) in enumerate(PAGES)]
    # The default page is served at "/"; its own path (/overview) opens it too, through a hidden alias.
    first = PAGES[0]
    pages.append(st.Page(_run_script(first[0]), title=first[1], url_path=first[3], visibility="hidden"))
    st.navigation(pages).run()


def _run_script(name: str):
    def page():
        runpy.run_path(str(Path(__file__).with_name(name)), run_name="__main__")
    return page


main()
