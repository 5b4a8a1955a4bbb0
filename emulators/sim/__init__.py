"""The discrete-event simulator (DESIGN.md section 9): building blocks for projecting the testbed
to the paper's scale. `flows` is the flow-level model of the links."""
