# The two commands of the README. Each installs what it needs first.
PY := .venv/bin/python

.PHONY: demo test setup clean vm-image vm-test vm-smoke vm-shell vm-guest-test cluster-test

setup:
	@bash scripts/bootstrap.sh

demo: setup
	@$(PY) -m testbed.cli demo

test: setup
	@$(PY) -m pytest -q tests

clean: setup
	@$(PY) -m testbed.cli clean

# Soft-RoCE (rdma_rxe) in a VM built from Debian packages (scripts/vm.sh; docs/softroce.md).
vm-image:
	@bash scripts/vm.sh build

vm-test:
	@bash scripts/vm/vm-test.sh

# The rxe smoke alone: the image built or reused, a boot, and `dualpath check --rdma` inside (one
# NIXL READ and WRITE over rxe, proven by the rxe counters). CI's Soft-RoCE step.
vm-smoke:
	@VM_TEST_ARGS="--skip-bench --skip-e2e" VM_TEST_TIMEOUT=1800 bash scripts/vm/vm-test.sh

vm-shell: vm-image
	@bash scripts/vm.sh shell

# Inside a guest that already has the kernel and the venv (e.g. `vagrant ssh`, then sudo make ...).
vm-guest-test: setup
	@$(PY) scripts/vm/guest_test.py

# One topology over two servers: this machine and a QEMU guest of the VM image, joined by VXLAN
# tunnels (docs/cluster.md): prepare, the fabric across both, traffic through it, cleanup after
# down and after a SIGKILL, and `dualpath run` through every mode with d0's processes in the guest
# (about 24 minutes under TCG; CLUSTER_TEST_ARGS=--no-run skips it; CLUSTER_TEST_ARGS="--place s0=guest"
# puts the storage server there instead, about 6 minutes and FAITHFUL). results/cluster/<run-id>/summary.json.
cluster-test: setup
	@$(PY) scripts/cluster/cluster_test.py $(CLUSTER_TEST_ARGS)
