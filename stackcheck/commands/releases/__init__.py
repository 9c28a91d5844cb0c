"""Work over a package's releases (or commits): `bisect` finds where one family flips, `history` maps
every release through every family, `watch` follows new releases; all three share `probes`."""
