"""The management web UI in a real headless browser: Debian's chromium driven through chromedriver
(selenium). A person's path through it: log in, add a queue, publish to it, watch the counts move
as an AMQP client consumes, get a message, purge, delete, close a connection; as an administrator,
add a vhost and a user, give it a permission, change its password, clear the permission, delete
both. Every check reads the page as a person would, and checks the broker's side through AMQP
logins or the API.

Names come from clients: a queue, user or vhost named like HTML must show as its characters and
run nothing."""

import shutil
import time
import urllib.parse

import pika
import pytest
import requests
from pika.exceptions import ProbableAccessDeniedError, ProbableAuthenticationError

from conftest import eventually

pytestmark = pytest.mark.warren_only

selenium = pytest.importorskip("selenium", reason="selenium is not installed (scripts/install-test-deps.sh installs it)")
from selenium import webdriver  # noqa: E402
from selenium.webdriver.chrome.service import Service  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.support.ui import Select  # noqa: E402

CHROMIUM = shutil.which("chromium")
CHROMEDRIVER = shutil.which("chromedriver")
HOSTILE_NAME = '<img src=x onerror="window.pwned=1">q'


@pytest.fixture
def browser():
    if not CHROMIUM or not CHROMEDRIVER:
        pytest.skip("chromium and chromedriver are not installed (scripts/install-test-deps.sh installs them)")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu", "--window-size=1400,1000"):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    driver.implicitly_wait(0)
    yield driver
    driver.quit()


def ui(broker):
    return f"http://127.0.0.1:{broker.http_port}/"


def text_of(driver, css):
    return driver.find_element(By.CSS_SELECTOR, css).text


def wait_text(driver, css, predicate, timeout=15):
    """Polls until the element's text satisfies `predicate` (the page refreshes every 5 s)."""
    return eventually(lambda: predicate(text_of(driver, css)) and text_of(driver, css), timeout=timeout, interval=0.1)


def log_in(driver, broker, user="guest", password="guest"):
    driver.get(ui(broker))
    eventually(lambda: driver.find_elements(By.CSS_SELECTOR, "#login input[name=username]"))
    driver.find_element(By.CSS_SELECTOR, "#login input[name=username]").send_keys(user)
    driver.find_element(By.CSS_SELECTOR, "#login input[name=password]").send_keys(password)
    driver.find_element(By.CSS_SELECTOR, "#login button[type=submit]").click()


def click_twice(driver, button_text):
    """A danger button asks to be pressed again."""
    press_twice(eventually(lambda: next((b for b in driver.find_elements(By.CSS_SELECTOR, "button.danger") if b.text == button_text), None)))


def press_twice(button):
    button.click()
    eventually(lambda: button.text.startswith("Really"))
    button.click()


def row_cells(driver, table_css, first_cells):
    """The cells of the table row whose leading cells read `first_cells`."""
    for row in driver.find_elements(By.CSS_SELECTOR, f"{table_css} tbody tr"):
        cells = [c.text for c in row.find_elements(By.TAG_NAME, "td")]
        if cells[: len(first_cells)] == list(first_cells):
            return cells
    return None


def row_button(driver, table_css, first_cells, button_text, column=None):
    """The button reading `button_text` in the row whose leading cells read `first_cells` (in the
    cell under the column titled `column`, if given); None if there is none yet."""
    titles = [th.text for th in driver.find_elements(By.CSS_SELECTOR, f"{table_css} thead th")]
    for row in driver.find_elements(By.CSS_SELECTOR, f"{table_css} tbody tr"):
        cells = row.find_elements(By.TAG_NAME, "td")
        if [c.text for c in cells[: len(first_cells)]] == list(first_cells):
            where = cells[titles.index(column)] if column else row
            return next((b for b in where.find_elements(By.TAG_NAME, "button") if b.text == button_text), None)
    return None


def row_cell(driver, table_css, first_cells, column):
    """The text under the column titled `column` in the row whose leading cells read `first_cells`."""
    titles = [th.text for th in driver.find_elements(By.CSS_SELECTOR, f"{table_css} thead th")]
    cells = row_cells(driver, table_css, first_cells)
    return None if cells is None else cells[titles.index(column)]


def cell(driver, table_css, column):
    """The text under the column titled `column` in a one-row table."""
    titles = [th.text for th in driver.find_elements(By.CSS_SELECTOR, f"{table_css} thead th")]
    cells = driver.find_elements(By.CSS_SELECTOR, f"{table_css} tbody tr td")
    return cells[titles.index(column)].text


def wait_cell(driver, table_css, column, expected, timeout=15):
    eventually(lambda: cell(driver, table_css, column) == expected, timeout=timeout, interval=0.1)


def script_errors(driver):
    """Console entries that mean the page broke: uncaught errors and blocked (CSP) content."""
    return [e["message"] for e in driver.get_log("browser") if e["level"] == "SEVERE" and ("Uncaught" in e["message"] or "Content Security Policy" in e["message"])]


def test_ui_is_embedded_and_locked_down(broker):
    page = requests.get(ui(broker), timeout=5)
    assert page.status_code == 200 and "text/html" in page.headers["Content-Type"]
    assert '<script src="/ui/app.js"' in page.text
    csp = page.headers["Content-Security-Policy"]
    assert "default-src 'self'" in csp and "frame-ancestors 'none'" in csp and "unsafe-inline" not in csp
    assert page.headers["X-Frame-Options"] == "DENY"
    for asset, kind in (("ui/app.js", "javascript"), ("ui/app.css", "css")):
        r = requests.get(ui(broker) + asset, timeout=5)
        assert r.status_code == 200 and kind in r.headers["Content-Type"] and len(r.content) > 1000
    # The files need no login; the API behind them does. A script's 401 comes without
    # WWW-Authenticate (the browser would open its own password dialog over the login form).
    refused = requests.get(ui(broker) + "api/overview", timeout=5)
    assert refused.status_code == 401 and refused.headers["WWW-Authenticate"].startswith("Basic")
    refused = requests.get(ui(broker) + "api/overview", headers={"X-Requested-With": "XMLHttpRequest"}, auth=("guest", "wrong"), timeout=5)
    assert refused.status_code == 401 and "WWW-Authenticate" not in refused.headers


def test_log_in_add_publish_watch_counts_get_purge_delete(broker, browser):
    log_in(browser, broker, password="wrong")
    wait_text(browser, "#flash", lambda t: "wrong user name or password" in t)
    assert not browser.find_elements(By.CSS_SELECTOR, "#user")

    log_in(browser, broker)
    wait_text(browser, "#user", lambda t: t == "guest")
    wait_text(browser, "#totals", lambda t: "Ready" in t and "Queues" in t)
    assert browser.find_element(By.ID, "queued-chart").is_displayed()

    # Add a quorum queue and a classic one through the form.
    browser.find_element(By.LINK_TEXT, "Queues").click()
    form = eventually(lambda: browser.find_element(By.ID, "add-queue"))
    for name, kind in (("ui-classic", "classic"), ("ui-quorum", "quorum")):
        form.find_element(By.NAME, "name").clear()
        form.find_element(By.NAME, "name").send_keys(name)
        form.find_element(By.CSS_SELECTOR, f"select[name=type] option[value={kind}]").click()
        form.find_element(By.CSS_SELECTOR, "button[type=submit]").click()
        eventually(lambda: row_cells(browser, "#queues", ["/", name]))
        assert row_cells(browser, "#queues", ["/", name])[2] == kind
    api = f"http://127.0.0.1:{broker.http_port}/api/queues/%2F/"
    assert requests.get(api + "ui-quorum", auth=("guest", "guest"), timeout=5).json()["type"] == "quorum"

    # Publish three messages from the queue's page; the counts show them.
    browser.find_element(By.LINK_TEXT, "ui-classic").click()
    publish = eventually(lambda: browser.find_element(By.ID, "publish"))
    for i in range(3):
        publish.find_element(By.NAME, "payload").clear()
        publish.find_element(By.NAME, "payload").send_keys(f"from the UI {i}")
        publish.find_element(By.CSS_SELECTOR, "button[type=submit]").click()
        # One at a time, so that they are queued in order.
        eventually(lambda: requests.get(api + "ui-classic", auth=("guest", "guest"), timeout=5).json()["messages_ready"] == i + 1)
    wait_text(browser, "#flash", lambda t: "published" in t)
    wait_cell(browser, "#queue", "Ready", "3")

    # An AMQP client takes one: the page's count moves on its own (polling).
    conn = broker.connection()
    ch = conn.channel()
    method, _, body = ch.basic_get("ui-classic", auto_ack=True)
    assert body == b"from the UI 0"
    wait_cell(browser, "#queue", "Ready", "2")

    # Get one and remove it; the page shows its payload.
    get = browser.find_element(By.ID, "get")
    get.find_element(By.CSS_SELECTOR, "select[name=ackmode] option[value=ack_requeue_false]").click()
    get.find_element(By.CSS_SELECTOR, "button[type=submit]").click()
    wait_text(browser, "#got", lambda t: "from the UI 1" in t)
    wait_cell(browser, "#queue", "Ready", "1")

    # Purge (two presses), then delete: back on the list, and gone from the broker.
    click_twice(browser, "Purge")
    wait_cell(browser, "#queue", "Ready", "0")
    assert ch.queue_declare("ui-classic", passive=True).method.message_count == 0
    click_twice(browser, "Delete")
    eventually(lambda: browser.current_url.endswith("#/queues"))
    assert requests.get(api + "ui-classic", auth=("guest", "guest"), timeout=5).status_code == 404
    eventually(lambda: row_cells(browser, "#queues", ["/", "ui-quorum"]) and not row_cells(browser, "#queues", ["/", "ui-classic"]))
    conn.close()
    assert script_errors(browser) == []


def test_a_name_that_looks_like_html_is_shown_as_text(broker, browser):
    conn = broker.connection()
    ch = conn.channel()
    ch.queue_declare(HOSTILE_NAME)
    ch.basic_publish("", HOSTILE_NAME, b"<script>window.pwned=2</script>")
    log_in(browser, broker)
    wait_text(browser, "#user", lambda t: t == "guest")
    browser.get(ui(broker) + "#/queues")
    eventually(lambda: row_cells(browser, "#queues", ["/", HOSTILE_NAME]))
    assert not browser.find_elements(By.CSS_SELECTOR, "#queues img")
    # Its page, and its message's payload, also as text.
    browser.get(ui(broker) + "#/queues/%2F/" + urllib.parse.quote(HOSTILE_NAME, safe=""))
    wait_text(browser, "#queue-name", lambda t: t == HOSTILE_NAME)
    browser.find_element(By.CSS_SELECTOR, "#get button[type=submit]").click()
    wait_text(browser, "#got", lambda t: "<script>window.pwned=2</script>" in t)
    assert not browser.find_elements(By.CSS_SELECTOR, "#main img, #got script")
    assert browser.execute_script("return window.pwned === undefined")
    conn.close()


def test_close_a_connection_from_the_ui(broker, browser):
    conn = broker.connection(client_properties={"product": "ui-test-client"})
    log_in(browser, broker)
    wait_text(browser, "#user", lambda t: t == "guest")
    browser.find_element(By.LINK_TEXT, "Connections").click()
    wait_text(browser, "#connections", lambda t: "ui-test-client" in t)
    click_twice(browser, "Close")
    wait_text(browser, "#connections", lambda t: "ui-test-client" not in t)

    with pytest.raises(pika.exceptions.ConnectionClosedByBroker) as closed:
        deadline = time.time() + 10
        while time.time() < deadline:
            conn.process_data_events(time_limit=0.1)
    assert closed.value.reply_code == 320 and "Closed from the management UI" in closed.value.reply_text
    # Logging out forgets the credentials: a reload asks again.
    browser.find_element(By.ID, "logout").click()
    browser.get(ui(broker))
    eventually(lambda: browser.find_elements(By.CSS_SELECTOR, "#login"))
    assert script_errors(browser) == []


def test_rewind_from_the_queue_page(broker, browser):
    """A classic queue with retention: the page shows what it keeps, and a rewind from it makes the
    consumed messages ready again (the counts move); a refused rewind says why."""
    conn = broker.connection()
    ch = conn.channel()
    ch.queue_declare("ui-rewound", durable=True, arguments={"x-retention-seconds": 3600})
    ch.confirm_delivery()
    for i in range(4):
        ch.basic_publish("", "ui-rewound", b"kept %d" % i, pika.BasicProperties(delivery_mode=2))
    for _ in range(4):
        method, _, _ = ch.basic_get("ui-rewound")
        ch.basic_ack(method.delivery_tag)
    log_in(browser, broker)
    wait_text(browser, "#user", lambda t: t == "guest")
    browser.find_element(By.LINK_TEXT, "Queues").click()
    eventually(lambda: browser.find_element(By.LINK_TEXT, "ui-rewound")).click()
    wait_cell(browser, "#queue", "Retained", "4")
    wait_cell(browser, "#queue", "Ready", "0")
    form = browser.find_element(By.ID, "rewind")
    form.find_element(By.NAME, "to").clear()
    form.find_element(By.NAME, "to").send_keys("yesterday")
    form.find_element(By.CSS_SELECTOR, "button[type=submit]").click()
    wait_text(browser, "#flash", lambda t: "not a point in time" in t)
    form.find_element(By.NAME, "to").clear()
    form.find_element(By.NAME, "to").send_keys("-1h")
    form.find_element(By.CSS_SELECTOR, "button[type=submit]").click()
    wait_text(browser, "#flash", lambda t: "Rewound 4 messages from 20" in t)
    wait_cell(browser, "#queue", "Ready", "4")
    wait_cell(browser, "#queue", "Retained", "0")
    assert [ch.basic_get("ui-rewound", auto_ack=True)[2] for _ in range(4)] == [b"kept %d" % i for i in range(4)]
    conn.close()
    assert script_errors(browser) == []


def test_add_a_delayed_exchange_and_watch_its_queue_s_delayed_count(broker, browser):
    """The exchange form makes an x-delayed-message exchange ("delayed topic": x-delayed-type
    topic); a queue's page counts what a delayed exchange holds for it until it is due."""
    log_in(browser, broker)
    wait_text(browser, "#user", lambda t: t == "guest")
    browser.find_element(By.LINK_TEXT, "Exchanges").click()
    form = eventually(lambda: browser.find_element(By.ID, "add-exchange"))
    form.find_element(By.NAME, "name").send_keys("ui-later")
    form.find_element(By.CSS_SELECTOR, "select[name=type] option[value='delayed topic']").click()
    form.find_element(By.CSS_SELECTOR, "button[type=submit]").click()
    eventually(lambda: row_cells(browser, "#exchanges", ["/", "ui-later"]))
    assert row_cells(browser, "#exchanges", ["/", "ui-later"])[2] == "x-delayed-message"
    shown = requests.get(f"http://127.0.0.1:{broker.http_port}/api/exchanges/%2F/ui-later", auth=("guest", "guest"), timeout=5).json()
    assert shown["arguments"] == {"x-delayed-type": "topic"}
    conn = broker.connection()
    ch = conn.channel()
    ch.queue_declare("ui-delayed", durable=True)
    ch.queue_bind("ui-delayed", "ui-later", "a.#")
    ch.confirm_delivery()
    for i in range(3):
        ch.basic_publish("ui-later", "a.b", b"later %d" % i, pika.BasicProperties(delivery_mode=2, headers={"x-delay": 8000}))
    browser.find_element(By.LINK_TEXT, "Queues").click()
    eventually(lambda: browser.find_element(By.LINK_TEXT, "ui-delayed")).click()
    wait_cell(browser, "#queue", "Delayed", "3")
    wait_cell(browser, "#queue", "Ready", "0")
    wait_cell(browser, "#queue", "Ready", "3")
    wait_cell(browser, "#queue", "Delayed", "0")
    conn.close()
    assert script_errors(browser) == []


# ---- Admin: users, virtual hosts, permissions ----

AUTH = ("guest", "guest")


def api_url(broker, path):
    return f"http://127.0.0.1:{broker.http_port}/api{path}"


def q(name):
    return urllib.parse.quote(name, safe="")


def fill(form, **fields):
    for name, value in fields.items():
        field = form.find_element(By.NAME, name)
        field.clear()
        field.send_keys(value)


def submit(form):
    form.find_element(By.CSS_SELECTOR, "button[type=submit]").click()


def amqp(broker, user, password, vhost):
    return pika.BlockingConnection(pika.ConnectionParameters(broker.host, broker.port, vhost, pika.PlainCredentials(user, password)))


def round_trip(broker, user, password, vhost):
    """Logs in as `user` to `vhost`, publishes one message (confirmed) to a new queue and takes
    what the queue has: the number of messages taken."""
    conn = amqp(broker, user, password, vhost)
    ch = conn.channel()
    ch.confirm_delivery()
    queue = ch.queue_declare("", exclusive=True).method.queue
    ch.basic_publish("", queue, b"allowed by the UI")
    taken = 0
    while True:
        method, _, body = ch.basic_get(queue, auto_ack=True)
        if method is None:
            break
        assert body == b"allowed by the UI"
        taken += 1
    conn.close()
    return taken


def refused(broker, user, password, vhost, kind):
    """The text of the connection.close that refused this login (pika raises `kind`, keeping the
    close only in its message: 'ConnectionClosedByBroker: (530) "..."')."""
    with pytest.raises(kind) as e:
        amqp(broker, user, password, vhost)
    return e.value.args[0]


def open_admin(driver, broker):
    log_in(driver, broker)
    wait_text(driver, "#user", lambda t: t == "guest")
    admin = driver.find_element(By.LINK_TEXT, "Admin")
    assert admin.is_displayed()
    admin.click()
    eventually(lambda: row_cells(driver, "#users", ["guest"]))


def test_admin_add_vhost_and_user_grant_change_password_clear_and_delete(broker, browser):
    vhost, user = "ui-vhost", "ui-user"
    open_admin(browser, broker)
    assert row_cells(browser, "#users", ["guest"]) == ["guest", "administrator", "/", "yes"]

    # A vhost, through the form; adding it again is refused (a PUT would clear its tags).
    browser.find_element(By.LINK_TEXT, "Virtual hosts").click()
    form = eventually(lambda: browser.find_element(By.ID, "add-vhost"))
    fill(form, name=vhost, description="made in the UI")
    submit(form)
    eventually(lambda: row_cells(browser, "#vhosts", [vhost, "made in the UI"]))
    assert requests.get(api_url(broker, f"/vhosts/{vhost}"), auth=AUTH, timeout=5).json()["description"] == "made in the UI"
    fill(form, name=vhost)
    submit(form)
    wait_text(browser, "#flash", lambda t: t == f"Virtual host {vhost} already exists.")

    # A user with a password and the management tag: no permission yet.
    browser.find_element(By.LINK_TEXT, "Users").click()
    form = eventually(lambda: browser.find_element(By.ID, "add-user"))
    fill(form, name=user, password="first-pw", tags="management")
    submit(form)
    eventually(lambda: row_cells(browser, "#users", [user]))
    assert row_cells(browser, "#users", [user]) == [user, "management", "No access", "yes"]
    assert requests.get(api_url(broker, f"/users/{user}"), auth=AUTH, timeout=5).json()["tags"] == ["management"]
    assert "530" in refused(broker, user, "first-pw", vhost, ProbableAccessDeniedError)

    # Its page: a permission on the new vhost (the patterns' defaults: everything).
    browser.find_element(By.LINK_TEXT, user).click()
    wait_text(browser, "#user-name", lambda t: t == user)
    wait_text(browser, "#user-permissions", lambda t: "No permissions" in t)
    form = browser.find_element(By.ID, "set-permission")
    Select(form.find_element(By.NAME, "vhost")).select_by_value(vhost)
    submit(form)
    eventually(lambda: row_cells(browser, "#user-permissions", [vhost, ".*", ".*", ".*"]))
    permission = {"user": user, "vhost": vhost, "configure": ".*", "write": ".*", "read": ".*"}
    assert requests.get(api_url(broker, f"/permissions/{vhost}/{user}"), auth=AUTH, timeout=5).json() == permission
    assert round_trip(broker, user, "first-pw", vhost) == 1
    text = refused(broker, user, "first-pw", "/", ProbableAccessDeniedError)
    assert "(530)" in text and f"access to vhost '/' refused for user '{user}'" in text

    # The overview of permissions lists it; its user's link leads back.
    browser.find_element(By.LINK_TEXT, "Permissions").click()
    eventually(lambda: row_cells(browser, "#permissions", [user, vhost, ".*", ".*", ".*"]))
    eventually(lambda: row_cells(browser, "#permissions", ["guest", vhost]))  # its creator's, given with it
    browser.find_element(By.CSS_SELECTOR, f"#permissions a[href='#/users/{user}']").click()
    wait_text(browser, "#user-name", lambda t: t == user)

    # A new password: the old one is refused, the new one works; the tags stay.
    form = eventually(lambda: browser.find_element(By.ID, "change-password"))
    fill(form, password="second-pw")
    submit(form)
    wait_text(browser, "#flash", lambda t: t == "Password changed.")
    assert "(403)" in refused(broker, user, "first-pw", vhost, ProbableAuthenticationError)
    assert round_trip(broker, user, "second-pw", vhost) == 1
    assert requests.get(api_url(broker, f"/users/{user}"), auth=AUTH, timeout=5).json()["tags"] == ["management"]

    # New tags: the password stays.
    form = browser.find_element(By.ID, "set-tags")
    assert form.find_element(By.NAME, "tags").get_attribute("value") == "management"
    fill(form, tags="management, monitoring")
    submit(form)
    wait_text(browser, "#flash", lambda t: t == "Tags set.")
    wait_cell(browser, "#user-info", "Tags", "management, monitoring")
    assert requests.get(api_url(broker, f"/users/{user}"), auth=AUTH, timeout=5).json()["tags"] == ["management", "monitoring"]
    assert round_trip(broker, user, "second-pw", vhost) == 1

    # The permission cleared: the login to the vhost is refused.
    press_twice(eventually(lambda: row_button(browser, "#user-permissions", [vhost], "Clear")))
    wait_text(browser, "#user-permissions", lambda t: "No permissions" in t)
    assert "(530)" in refused(broker, user, "second-pw", vhost, ProbableAccessDeniedError)
    assert requests.get(api_url(broker, f"/permissions/{vhost}/{user}"), auth=AUTH, timeout=5).status_code == 404

    # The user deleted, then the vhost: gone from the pages and from the API.
    click_twice(browser, "Delete user")
    eventually(lambda: browser.current_url.endswith("#/users"))
    eventually(lambda: row_cells(browser, "#users", ["guest"]) and not row_cells(browser, "#users", [user]))
    assert requests.get(api_url(broker, f"/users/{user}"), auth=AUTH, timeout=5).status_code == 404
    browser.find_element(By.LINK_TEXT, "Virtual hosts").click()
    press_twice(eventually(lambda: row_button(browser, "#vhosts", [vhost], "Delete")))
    eventually(lambda: row_cells(browser, "#vhosts", ["/"]) and not row_cells(browser, "#vhosts", [vhost]))
    assert requests.get(api_url(broker, f"/vhosts/{vhost}"), auth=AUTH, timeout=5).status_code == 404
    assert script_errors(browser) == []


def test_admin_sets_and_clears_vhost_limits(broker, browser):
    vhost = "ui-limited"
    assert requests.put(api_url(broker, f"/vhosts/{vhost}"), json={}, auth=AUTH, timeout=5).status_code == 201
    open_admin(browser, broker)
    browser.find_element(By.LINK_TEXT, "Virtual hosts").click()
    eventually(lambda: row_cells(browser, "#vhosts", [vhost]))
    form = browser.find_element(By.ID, "set-limit")
    for key, column in (("max-connections", "Max connections"), ("max-queues", "Max queues")):
        eventually(lambda: Select(form.find_element(By.NAME, "vhost")).select_by_value(vhost) or True)
        Select(form.find_element(By.NAME, "limit")).select_by_value(key)
        fill(form, value="1")
        submit(form)
        eventually(lambda: row_cell(browser, "#vhosts", [vhost], column) == "1 Clear")
    limits = requests.get(api_url(broker, f"/vhost-limits/{vhost}"), auth=AUTH, timeout=5).json()
    assert limits == [{"vhost": vhost, "value": {"max-connections": 1, "max-queues": 1}}]
    conn = amqp(broker, "guest", "guest", vhost)
    assert "connection limit (1) is reached" in refused(broker, "guest", "guest", vhost, ProbableAccessDeniedError)
    ch = conn.channel()
    ch.queue_declare("ui-q1")
    with pytest.raises(pika.exceptions.ChannelClosedByBroker) as e:
        ch.queue_declare("ui-q2")
    assert e.value.reply_code == 406

    # Each cleared from its cell: the broker takes one more connection, then one more queue.
    row_button(browser, "#vhosts", [vhost], "Clear", column="Max connections").click()
    eventually(lambda: row_cell(browser, "#vhosts", [vhost], "Max connections") == "")
    assert row_cell(browser, "#vhosts", [vhost], "Max queues") == "1 Clear"
    second = amqp(broker, "guest", "guest", vhost)
    row_button(browser, "#vhosts", [vhost], "Clear", column="Max queues").click()
    eventually(lambda: row_cell(browser, "#vhosts", [vhost], "Max queues") == "")
    second.channel().queue_declare("ui-q2")
    assert requests.get(api_url(broker, f"/vhost-limits/{vhost}"), auth=AUTH, timeout=5).json() == []
    second.close()
    conn.close()
    assert script_errors(browser) == []


def test_admin_pages_show_a_user_and_vhost_named_like_html_as_text(broker, browser):
    open_admin(browser, broker)
    browser.find_element(By.LINK_TEXT, "Virtual hosts").click()
    form = eventually(lambda: browser.find_element(By.ID, "add-vhost"))
    fill(form, name=HOSTILE_NAME, description=HOSTILE_NAME)
    submit(form)
    wait_text(browser, "#flash", lambda t: t.startswith(f"Virtual host {HOSTILE_NAME} added"))
    eventually(lambda: row_cells(browser, "#vhosts", [HOSTILE_NAME, HOSTILE_NAME]))

    browser.find_element(By.LINK_TEXT, "Users").click()
    form = eventually(lambda: browser.find_element(By.ID, "add-user"))
    fill(form, name=HOSTILE_NAME, password="pw", tags=HOSTILE_NAME)
    submit(form)
    wait_text(browser, "#flash", lambda t: t == f"User {HOSTILE_NAME} added.")
    eventually(lambda: row_cells(browser, "#users", [HOSTILE_NAME, HOSTILE_NAME, "No access", "yes"]))
    browser.find_element(By.LINK_TEXT, HOSTILE_NAME).click()
    wait_text(browser, "#user-name", lambda t: t == HOSTILE_NAME)
    form = browser.find_element(By.ID, "set-permission")
    eventually(lambda: Select(form.find_element(By.NAME, "vhost")).select_by_value(HOSTILE_NAME) or True)
    fill(form, read="<b>q</b>")
    submit(form)
    eventually(lambda: row_cells(browser, "#user-permissions", [HOSTILE_NAME, ".*", ".*", "<b>q</b>"]))
    # The path segments were encoded: the permission is the one for these names, and it logs in.
    shown = requests.get(api_url(broker, f"/permissions/{q(HOSTILE_NAME)}/{q(HOSTILE_NAME)}"), auth=AUTH, timeout=5).json()
    assert shown == {"user": HOSTILE_NAME, "vhost": HOSTILE_NAME, "configure": ".*", "write": ".*", "read": "<b>q</b>"}
    amqp(broker, HOSTILE_NAME, "pw", HOSTILE_NAME).close()

    browser.find_element(By.LINK_TEXT, "Permissions").click()
    eventually(lambda: row_cells(browser, "#permissions", [HOSTILE_NAME, HOSTILE_NAME, ".*", ".*", "<b>q</b>"]))
    browser.find_element(By.LINK_TEXT, "Users").click()
    eventually(lambda: row_cells(browser, "#users", [HOSTILE_NAME, HOSTILE_NAME, HOSTILE_NAME, "yes"]))
    assert not browser.find_elements(By.CSS_SELECTOR, "#main img, #main b")
    assert browser.execute_script("return window.pwned === undefined")

    # Deleted through the UI: the encoded paths reach them.
    browser.find_element(By.LINK_TEXT, HOSTILE_NAME).click()
    wait_text(browser, "#user-name", lambda t: t == HOSTILE_NAME)
    click_twice(browser, "Delete user")
    eventually(lambda: browser.current_url.endswith("#/users"))
    browser.find_element(By.LINK_TEXT, "Virtual hosts").click()
    press_twice(eventually(lambda: row_button(browser, "#vhosts", [HOSTILE_NAME], "Delete")))
    wait_text(browser, "#flash", lambda t: t == f"Virtual host {HOSTILE_NAME} deleted.")
    assert requests.get(api_url(broker, f"/users/{q(HOSTILE_NAME)}"), auth=AUTH, timeout=5).status_code == 404
    assert requests.get(api_url(broker, f"/vhosts/{q(HOSTILE_NAME)}"), auth=AUTH, timeout=5).status_code == 404
    assert not browser.find_elements(By.CSS_SELECTOR, "#main img, #main b")
    assert browser.execute_script("return window.pwned === undefined")
    assert script_errors(browser) == []


def test_admin_is_not_offered_to_a_management_user(broker, browser):
    user = "ui-manager"
    assert requests.put(api_url(broker, f"/users/{user}"), json={"password": "pw", "tags": "management"}, auth=AUTH, timeout=5).status_code == 201
    assert requests.put(api_url(broker, f"/permissions/%2F/{user}"), json={"configure": ".*", "write": ".*", "read": ".*"}, auth=AUTH, timeout=5).status_code == 201
    log_in(browser, broker)
    wait_text(browser, "#user", lambda t: t == "guest")
    assert browser.find_element(By.LINK_TEXT, "Admin").is_displayed()
    browser.find_element(By.ID, "logout").click()

    log_in(browser, broker, user, "pw")
    wait_text(browser, "#user", lambda t: t == user)
    # Its overview works (without the nodes: those are for monitoring users).
    wait_text(browser, "#totals", lambda t: "Ready" in t and "Queues" in t)
    assert not browser.find_elements(By.ID, "nodes")
    assert browser.find_element(By.ID, "flash").get_attribute("textContent") == ""
    assert [a.text for a in browser.find_elements(By.CSS_SELECTOR, "#nav a") if a.is_displayed()] == ["Overview", "Queues", "Exchanges", "Connections", "Channels"]
    assert not browser.find_element(By.ID, "nav-admin").is_displayed()
    # Typed in: the API's refusal is shown, and the user stays logged in.
    browser.get(ui(broker) + "#/users")
    wait_text(browser, "#flash", lambda t: t == "Not administrator user")
    assert text_of(browser, "#user") == user and not browser.find_elements(By.ID, "login")
    assert script_errors(browser) == []
