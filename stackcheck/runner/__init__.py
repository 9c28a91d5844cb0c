"""The command side's machinery: building a set's environment and launching the pytest child."""
