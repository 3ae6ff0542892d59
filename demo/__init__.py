"""colocd.demo: ``colocd demo``, a tiny real RL loop through the full handoff on the reference engine (``loop``)."""
