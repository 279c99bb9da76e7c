"""Exit 0 when the URL given (default: the local gunicorn) answers below HTTP 500.

Used as the app containers' healthcheck: python:3.11-slim has no curl or wget.
A 4xx still proves gunicorn and Django are serving; a 5xx, a refused connection or
a timeout does not.
"""

import sys
import urllib.error
import urllib.request

URL = sys.argv[1] if len(sys.argv) > 1 else "http://127.0.0.1:8000/shop/"


def main() -> int:
    """Return the process exit code for one probe of ``URL``."""
    try:
        with urllib.request.urlopen(URL, timeout=5) as response:
            status = response.status
    except urllib.error.HTTPError as error:
        status = error.code
    except OSError as error:
        print(f"unhealthy: {URL}: {error}", file=sys.stderr)
        return 1
    if status >= 500:
        print(f"unhealthy: {URL}: HTTP {status}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
