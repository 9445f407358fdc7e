"""The data a job trains on: packed documents (packing.py) and the tasks behind them (tasks/)."""
