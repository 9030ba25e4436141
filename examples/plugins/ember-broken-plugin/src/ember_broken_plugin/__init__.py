"""An ember plugin broken on purpose, for tests: importing its plugin module fails. ember must
record and report the failure and keep the built-ins and the other plugins working."""
