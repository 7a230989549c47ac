#!/usr/bin/env bash
# Make pyverbs (rdma-core's Python bindings) importable from the project's virtualenv on Debian/Ubuntu.
#
# Why not `pip install pyverbs`: the PyPI sdist tracks the newest rdma-core (59.x at the time of
# writing), needs Cython 3.0.x to build and then fails at import against an older system libibverbs
# (`IBVERBS_PRIVATE_59 not found`). The distribution's python3-pyverbs is built against the system
# rdma-core, so we install that and link its package folder into the venv.
#
# Usage: scripts/install_pyverbs.sh [VENV]        (default: .venv)
#
# Makefile target (the lead wires this in):
#
#   rdma: $(STAMP)
#   	scripts/install_pyverbs.sh $(VENV)
#
set -euo pipefail

VENV="${1:-.venv}"
PY="$VENV/bin/python"
SYSTEM_PKG_DIR=/usr/lib/python3/dist-packages/pyverbs

if [[ ! -x "$PY" ]]; then
  echo "install_pyverbs: no interpreter at $PY; create the venv first (make install)" >&2
  exit 1
fi

if ! command -v apt-get >/dev/null; then
  echo "install_pyverbs: apt-get not found; on other distributions install rdma-core's" \
    "python bindings (python3-pyverbs / rdma-core-python) and link their pyverbs folder into" \
    "$VENV's site-packages by hand" >&2
  exit 1
fi

SUDO=""
if [[ $EUID -ne 0 ]]; then
  SUDO="sudo"
fi

# python3-pyverbs: the bindings; rdma-core: rdma tool, udev rules, SoftRoCE (rdma_rxe) userspace;
# ibverbs-providers: the user-space drivers (mlx5, rxe, efa, ...) without which no device shows up.
$SUDO apt-get update -q
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q --no-install-recommends \
  python3-pyverbs rdma-core ibverbs-providers ibverbs-utils iproute2

if [[ ! -d "$SYSTEM_PKG_DIR" ]]; then
  echo "install_pyverbs: $SYSTEM_PKG_DIR missing after installing python3-pyverbs" >&2
  exit 1
fi

# The system package is built for the distribution's python3; the venv's interpreter must be the
# same minor version or the compiled extension modules will not load.
sys_ver="$(ls "$SYSTEM_PKG_DIR"/*.so | head -n1 | sed -n 's/.*cpython-\([0-9]*\)-.*/\1/p')"
venv_ver="$("$PY" -c 'import sys; print(f"{sys.version_info[0]}{sys.version_info[1]}")')"
if [[ -n "$sys_ver" && "$sys_ver" != "$venv_ver" ]]; then
  echo "install_pyverbs: system pyverbs is built for CPython $sys_ver, $VENV runs $venv_ver;" \
    "recreate the venv with the system python3 or build pyverbs from rdma-core source" >&2
  exit 1
fi

site_dir="$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
ln -sfn "$SYSTEM_PKG_DIR" "$site_dir/pyverbs"

"$PY" - <<'EOF'
import pyverbs.device as d

print(f"pyverbs importable from {d.__file__}")
try:
    devices = d.get_device_list()
except Exception as exc:  # pyverbs raises PyverbsRDMAError when the kernel has no RDMA devices
    print(f"no RDMA device visible: {exc}")
    print("for a software device: modprobe rdma_rxe && rdma link add rxe0 type rxe netdev eth0")
else:
    names = [dev.name.decode() for dev in devices]
    print(f"RDMA devices: {names or 'none'}")
EOF
