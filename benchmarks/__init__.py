"""colocd.bench: the lab beside the product. Nothing in the daemon, the API or the trainer library imports it.

The benchmarks behind ``colocd bench`` (weights, control, switch), the studies run as ``python -m colocd.bench.X``,
``offload`` (a training rank's state and its offload, which ``bench switch`` drives) and ``timeline`` (the picture
``colocd trace`` and ``colocd demo --timeline`` draw). Each bench prints a table, writes a JSON record
(``records.write_record``) and measures the physical floor and the baselines in the same run, so results are ratios.
"""
