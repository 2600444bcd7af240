"""The measurements behind ``vip bench``: each module times a stage (or the DP step) beside a baseline
measured in the same run and returns the figures; ``tasks/cli/bench.py`` parses the arguments and prints them."""
