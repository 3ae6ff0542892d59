"""colocd.api"""
