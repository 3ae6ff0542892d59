"""colocd.policies"""
