"""Streamlit dashboard over run directories (streamlit, plotly, polars; never imports torch)."""
