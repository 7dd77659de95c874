"""The one exception type that reaches the user as a plain sentence."""


class UserError(Exception):
    """Bad input or a failed precondition the user can fix.

    The message is one sentence saying what is wrong and what to do. The CLI prints it
    to stderr and exits with `exit_code` (2 = bad usage/input, 1 = a failed check).
    """

    def __init__(self, message: str, exit_code: int = 2):
        super().__init__(message)
        self.exit_code = exit_code
