"""Shared by the sample-data generators: the error they raise on bad input."""
from utils.errors import UserError


class SampleDataError(UserError, ValueError):
    """Bad arguments or an existing data set; the CLI prints it as one line and exits 2."""
