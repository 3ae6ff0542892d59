"""colocd.engines"""
