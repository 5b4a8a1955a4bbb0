"""Checks and benches that calibrate the emulation against real tools (iperf3, fio, perftest)."""
