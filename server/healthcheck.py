"""The container's HEALTHCHECK: exit 0 when /healthz answers 200 on the port the server listens on.

Standard library only, so a probe every few seconds costs no imports of the server or torch.
"""

from __future__ import annotations

import os
import sys
import urllib.request


def main() -> int:
    port = os.environ.get("LONGDOC_PORT", "8000")
    direct = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # never through HTTP_PROXY
    try:
        with direct.open(f"http://127.0.0.1:{port}/healthz", timeout=3) as response:
            return 0 if response.status == 200 else 1
    except OSError:
        return 1


if __name__ == "__main__":
    sys.exit(main())
