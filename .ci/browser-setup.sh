#!/usr/bin/env bash
# Installs what tests/test_browser.py needs: Debian's chromium and Playwright's Python package.
# Playwright drives /usr/bin/chromium; it never downloads a browser of its own.
#   bash .ci/browser-setup.sh [VENV]      (VENV defaults to .venv in the repository root)
set -euo pipefail

cd "$(dirname "$0")/.."
VENV="${1:-.venv}"

if [ ! -x /usr/bin/chromium ]; then
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends chromium fonts-dejavu-core >/dev/null
fi

if ! "$VENV/bin/python" -c "import playwright" 2>/dev/null; then
    "$VENV/bin/python" -m pip install --quiet "playwright>=1.45"
fi

/usr/bin/chromium --version
"$VENV/bin/python" -c "import importlib.metadata as m; print('playwright', m.version('playwright'))"
