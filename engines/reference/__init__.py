"""colocd.engines.reference"""
