"""`decode.py --trace`: every step's decisions recorded from outside the methods (record.py), the self-contained
page that shows them (page.html), and the headless browser that renders and tests it (browser.py)."""
