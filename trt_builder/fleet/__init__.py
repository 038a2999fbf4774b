"""Nightly rebuilds of a fleet of models: the fleet file, the nightly run and its history, its reports, and gc."""
