"""The Streamlit dashboard over run directories (streamlit, plotly, polars; never imports torch).

    app.py               entry script (`streamlit run app.py -- RUN...`): run selector, st.navigation
    page_*.py            one script per page: overview, density, blasst, stabilization, tiles,
                         curves (Accuracy-speedup), export
    data.py              cached, checked loading of run, fit and export files (Missing / Broken)
    derive.py            pure numpy/polars frames between files and charts
    charts_fit.py        chart builders of the fit pages (DataFrame -> plotly Figure)
    charts_run.py        chart builders of Overview, Tiles, Accuracy-speedup, Export
    results.py           the Accuracy-speedup result file format and its reader
    ui.py                page helpers: guarded sections, controls, plotting
    serve.py             `sparsecal dashboard` / the end of `sparsecal demo`: the server process
    drive.py             Playwright + Chromium driver (browser test and benchmark)
"""
