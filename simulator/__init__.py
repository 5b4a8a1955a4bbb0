"""The discrete-event simulator (DESIGN.md section 9): the testbed projected to the paper's scale.
`flows` is the flow-level link model, `network` the same model advanced lazily for large clusters,
`cluster` the SimPy cluster around the scheduler core, `calibration` the constants fitted on
testbed runs. testbed/sim/drive.py builds a cluster from a topology."""
