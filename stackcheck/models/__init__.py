"""The models under test: the built-in architectures, the rule that shrinks a config to a tiny model of the
same structure, and the tiny checkpoints and adapters built from them. Imports nothing else of stackcheck's."""
