"""``oomless ui``: the estimate, the plan, the check, the diagnosis and run reports in a
local web page.

service.py is the one place the page meets the library; views.py shapes the
library's JSON forms for the page; app.py serves them (Starlette + uvicorn, the
``ui`` extra). Importing this package imports no web framework.
"""
