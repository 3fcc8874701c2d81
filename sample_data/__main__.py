"""Command line of the sample-data generators: `python -m sample_data era5|cosmo|cifar100|imagefolder`."""
import sys

import sample_data
from sample_data.cosmo import add_cosmo_parser
from sample_data.era5 import add_era5_parser
from sample_data.images import add_cifar100_parser, add_imagefolder_parser
from utils.errors import ArgumentParser, UserError


def build_parser():
    parser = ArgumentParser(prog="python -m sample_data", description=sample_data.__doc__)
    subparsers = parser.add_subparsers(dest="dataset", required=True)
    add_era5_parser(subparsers)
    add_cosmo_parser(subparsers)
    add_cifar100_parser(subparsers)
    add_imagefolder_parser(subparsers)
    return parser


def main(argv=None):
    """CLI entry point; returns the exit code (2 with one stderr line on bad input)."""
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except UserError as error:  # SampleDataError
        print(f"error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
