"""Helpers of the browser tests: JupyterLab and headless Chromium (see ``lab``)."""
