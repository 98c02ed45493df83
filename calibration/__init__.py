"""Calibration: measure the target hardware (`measure`), fit the cost constants (`fit`), write them."""
