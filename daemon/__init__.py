"""colocd.daemon"""
