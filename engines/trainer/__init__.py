"""colocd.engines.trainer"""
