"""The ``quantpack`` command line: thin commands over the library API; ``--help`` is the documentation."""
from __future__ import annotations

import sys

import click

from . import __version__


class UsageFailure(click.ClickException):
    """A bad-input error: one line on stderr, exit code 2, no traceback."""

    exit_code = 2

    def show(self, file=None):
        click.echo(f"Error: {self.format_message()}", err=True, file=file)


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, prog_name="quantpack")
def cli():
    """quantpack: quantize Hugging Face checkpoints to packed 4/8-bit weights and run them fast.

    \b
    Typical use:
      quantpack convert meta-llama/Llama-3.1-8B --group-size 128
      quantpack verify Llama-3.1-8B-qp4g128
    """


def main(argv=None):
    try:
        cli.main(args=argv, prog_name="quantpack", standalone_mode=True)
    except KeyboardInterrupt:
        click.echo("Interrupted.", err=True)
        sys.exit(130)
