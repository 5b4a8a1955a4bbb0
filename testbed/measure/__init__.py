"""What a run measures: metrics, the fidelity verdict, monitors, reports and plots."""
