"""``oomless ui``: the estimate, the plan, the check, the diagnosis and run reports in a
local web page.

service.py (Estimate, Check, Diagnose), planning.py (Plan, Inference) and runs.py are
where the page meets the library; commands.py turns the page's values into the
`oomless` command shown beside each result and reads it with the CLI's own parser;
views.py shapes the library's JSON forms for the page; guard.py keeps the server
local (hosts, token, bodies); app.py serves them (Starlette + uvicorn, the ``ui``
extra). Importing this package imports no web framework.
"""
