"""`python -m holoserve.server.healthcheck`: exit 0 when /healthz answers 200 (the image's HEALTHCHECK).

Uses only the standard library so the slim image needs no curl.
"""
from __future__ import annotations

import os
import sys
import urllib.request


def main() -> int:
    port = os.environ.get("HOLOSERVE_PORT", "8000")
    url = f"http://127.0.0.1:{port}/healthz"
    try:
        with urllib.request.urlopen(url, timeout=float(os.environ.get("HOLOSERVE_HEALTHCHECK_TIMEOUT", "3"))) as r:
            return 0 if r.status == 200 else 1
    except Exception as e:  # any failure means unhealthy
        print(f"unhealthy: {url}: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
