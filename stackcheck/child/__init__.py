"""The pytest child: every stackcheck pytest plugin."""
