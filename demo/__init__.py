"""colocd.demo: ``colocd demo``, a tiny real RL loop through the full handoff (``loop``; vLLM and SGLang: ``live``)."""
