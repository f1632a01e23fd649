"""Keeping a run alive and exact through faults: the fault tracker every host agrees on
(faults.py), loss-spike and non-finite detection (anomaly.py), and the data position that resume
continues from (data_position.py)."""
