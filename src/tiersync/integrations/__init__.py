"""Serving-engine integrations. Each subpackage imports its engine; nothing here is
imported by ``import tiersync``."""
