"""Helpers the tests share: processes that die with the test run, servers, fleets."""
