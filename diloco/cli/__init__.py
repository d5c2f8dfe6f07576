"""The command line on top of everything: `diloco start / join / demo / simulate / bench / status /
plot / wan` (`main`), the demo's peers and live view (`demo`, `dashboard`), and the swarm's status
(`status`, `statusview`). Nothing below imports from here."""
