"""pool-manager: provisions sandboxes (cold and warm), keeps the warm pool (min idle per
pool spec) and admits every new or resumed sandbox against max running, across instances.
"""
