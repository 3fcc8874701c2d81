"""User mistakes end in one clear line and a non-zero exit, never a traceback."""
import argparse
import functools
import sys


class UserError(Exception):
    """A mistake the user can fix (bad config, missing data, sizes that do not divide)."""


def exit_on_user_error(main):
    """Run `main`; turn a UserError into `error: <message>` on stderr and exit code 2."""

    @functools.wraps(main)
    def wrapper(*args, **kwargs):
        try:
            return main(*args, **kwargs)
        except UserError as err:
            print(f"error: {err}", file=sys.stderr, flush=True)
            sys.exit(2)

    return wrapper


class ArgumentParser(argparse.ArgumentParser):
    """argparse that reports a bad flag in one line (no usage dump) and exits with code 2."""

    def error(self, message):
        print(f"error: {message} (see --help)", file=sys.stderr)
        sys.exit(2)
