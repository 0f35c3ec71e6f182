"""No tests: the error tests are named by component (test_compile_errors.py,
test_launch_errors.py) and their shared checks are error_checks.py's. This
module stays for the test files that still `import test_errors`."""
from error_checks import check_error, compile_error  # noqa: F401
