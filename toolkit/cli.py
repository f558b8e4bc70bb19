"""The ``sparsecal`` command line. Heavy layers are imported inside the subcommands so that
``sparsecal --help`` answers instantly."""
import typer

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="Calibrate block-sparse attention (BSFA, BLASST) on a real model.")


@app.callback()
def main():
    """sparsecal: capture attention statistics, fit thresholds, browse and export them."""
