"""colocd.engines.sglang"""
