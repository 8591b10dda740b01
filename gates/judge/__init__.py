"""Judging: model statistics, tolerance entries and the decision rules that turn check results into a verdict."""
