"""The JSON-schema suite of issue 38's targets (docs/structured-outputs.md, "Measuring"): schemas of the
kinds applications send, each with the short natural prompt an application would send with it.

- SUITE: nested objects, arrays bounded by minItems / maxItems, enums, bounded numbers, string patterns
  and formats (date, time, date-time, email, uri, uuid, ipv4, hostname), optional and nullable fields,
  $defs / $ref (recursive too), anyOf, const, booleans, additionalProperties false and maps.
- FIXED_KEYS: objects of 12-20 required keys whose values are enums or booleans: most of their text is
  forced by the grammar, which is what jump-forward decoding (engine guided_jump_forward) speeds up.

Plain data (no jsonschema, no llguidance): tests/test_guided_schemas.py checks every schema is a valid
Draft 2020-12 schema, compiles in the engine and holds the engine's outputs; scripts/compat/schema_suite.py
sends the suite to a server; trtprompt/bench/guided.py measures with it.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

# OpenAI's rule for response_format.json_schema.name: what a case's name must be to be sent as one.
NAME_PATTERN = re.compile(r"[a-zA-Z0-9_-]{1,64}")


@dataclass(frozen=True)
class SchemaCase:
    """One schema and the prompt sent with it."""

    name: str
    schema: dict[str, Any] = field(hash=False)
    prompt: str

    def __post_init__(self) -> None:
        if not NAME_PATTERN.fullmatch(self.name):
            raise ValueError(f"name must match {NAME_PATTERN.pattern}, got {self.name!r}")
        if not isinstance(self.schema, dict) or not self.schema:
            raise ValueError(f"schema of {self.name} must be a non-empty JSON object")
        if not self.prompt.strip():
            raise ValueError(f"prompt of {self.name} must not be empty")

    @property
    def schema_text(self) -> str:
        """The schema as the engine's guide (SamplingParams.guide for guide_type json_schema)."""
        return json.dumps(self.schema)


def obj(properties: dict[str, Any], optional: tuple[str, ...] = (), **more: Any) -> dict[str, Any]:
    """An object schema as strict clients send it: every property required except `optional`, no others."""
    return {"type": "object", "properties": properties,
            "required": [k for k in properties if k not in optional], "additionalProperties": False, **more}


def string(max_length: int | None = None, **more: Any) -> dict[str, Any]:
    return {"type": "string", **({"maxLength": max_length} if max_length is not None else {}), **more}


def enum(*values: str) -> dict[str, Any]:
    return {"type": "string", "enum": list(values)}


def integer(low: int | None = None, high: int | None = None) -> dict[str, Any]:
    return _bounded("integer", low, high)


def number(low: float | None = None, high: float | None = None) -> dict[str, Any]:
    return _bounded("number", low, high)


def _bounded(kind: str, low: float | None, high: float | None) -> dict[str, Any]:
    return {"type": kind, **({"minimum": low} if low is not None else {}),
            **({"maximum": high} if high is not None else {})}


def array(items: dict[str, Any], low: int | None = None, high: int | None = None) -> dict[str, Any]:
    return {"type": "array", "items": items, **({"minItems": low} if low is not None else {}),
            **({"maxItems": high} if high is not None else {})}


def nullable(schema: dict[str, Any]) -> dict[str, Any]:
    return {"anyOf": [schema, {"type": "null"}]}


BOOL: dict[str, Any] = {"type": "boolean"}
DATE = string(format="date")
EMAIL = string(format="email")
NAME = string(60)
TEXT = string(200)
CURRENCY = enum("USD", "EUR", "GBP", "JPY")
ADDRESS = obj({"street": NAME, "city": string(40), "postal_code": string(pattern=r"^[0-9A-Z -]{3,10}$"),
               "country": enum("US", "GB", "DE", "FR", "JP", "CA")})


def _cases_people() -> tuple[SchemaCase, ...]:
    return (
        SchemaCase("person_basic", obj({"name": NAME, "age": integer(0, 130), "is_student": BOOL}),
                   "Extract the person described here as JSON: Maria Lopez is a 23-year-old university student."),
        SchemaCase("contact_card", obj({"name": NAME, "email": EMAIL,
                                        "phone": string(pattern=r"^\+?[0-9 ()-]{7,20}$"),
                                        "website": string(format="uri")}, optional=("website",)),
                   "Make a contact card from this signature: John Smith, john.smith@example.com, +1 555 010 2233, "
                   "https://johnsmith.example.com"),
        SchemaCase("user_profile", {**obj({"username": string(pattern=r"^[a-z][a-z0-9_]{2,15}$"), "email": EMAIL,
                                           "billing": {"$ref": "#/$defs/address"},
                                           "shipping": {"$ref": "#/$defs/address"}}),
                                    "$defs": {"address": ADDRESS}},
                   "Create a user profile for user 'kim_lee' (kim@example.org) who lives at 12 Baker Street, "
                   "London NW1 6XE, GB and ships to the same address."),
        SchemaCase("resume_summary", obj({
            "name": NAME, "years_experience": integer(0, 50), "skills": array(string(30), 1, 6),
            "education": array(obj({"degree": enum("BSc", "MSc", "PhD", "BA", "MA"), "institution": NAME,
                                    "year": integer(1950, 2030)}), 0, 3)}),
                   "Summarize this resume: Ahmed Khan, 7 years as a backend engineer, Python, Go, Kubernetes, "
                   "PostgreSQL; BSc Computer Science, University of Toronto, 2016."),
        SchemaCase("nullable_names", obj({"first_name": NAME, "middle_name": {"type": ["string", "null"]},
                                          "last_name": NAME, "nickname": nullable(string(30))}),
                   "Split this name into parts, using null for missing parts: Robert James Fischer."),
        SchemaCase("entities", obj({"entities": array(obj({"text": NAME, "type": enum("PERSON", "ORG", "LOC",
                                                                                      "DATE")}), 0, 8)}),
                   "List the named entities in: Tim Cook announced in Cupertino on 9 September 2025 that Apple "
                   "would open a new office."),
    )


def _cases_commerce() -> tuple[SchemaCase, ...]:
    item = obj({"sku": string(pattern=r"^[A-Z]{2,4}-[0-9]{3,6}$"), "quantity": integer(1, 100),
                "unit_price": number(0, 10000)})
    return (
        SchemaCase("order_details", obj({
            "order_id": string(pattern=r"^ORD-[0-9]{4,8}$"),
            "customer": obj({"name": NAME, "email": EMAIL}),
            "items": array(item, 1, 5),
            "status": enum("pending", "paid", "shipped", "delivered", "cancelled")}),
                   "Extract the order details from: Order ORD-20931 placed by Dana White (dana@example.com): 2 x "
                   "KB-1042 at $49.99 and 1 x MS-220 at $19.50. Payment received, not shipped yet."),
        SchemaCase("invoice", obj({
            "invoice_number": string(pattern=r"^INV-[0-9]{3,8}$"), "issue_date": DATE, "due_date": DATE,
            "currency": CURRENCY,
            "line_items": array(obj({"description": string(80), "amount": number(0)}), 1, 4),
            "total": number(0)}),
                   "Extract the invoice: INV-5531 issued 2026-03-01, due 2026-03-31, in EUR. Consulting 10 hours: "
                   "1200.00; travel: 230.50. Total 1430.50."),
        SchemaCase("product_review", obj({"product": NAME, "rating": integer(1, 5),
                                          "sentiment": enum("positive", "neutral", "negative"),
                                          "pros": array(string(60), 0, 3), "cons": array(string(60), 0, 3)}),
                   "Analyze this review: 'The X200 headphones sound great and the battery lasts forever, but "
                   "they hurt my ears after an hour.' Four stars."),
        SchemaCase("payment_method", obj({"payment": {"anyOf": [
            obj({"type": {"const": "card"}, "brand": enum("visa", "mastercard", "amex"),
                 "last4": string(pattern=r"^[0-9]{4}$")}),
            obj({"type": {"const": "bank_transfer"}, "iban": string(pattern=r"^[A-Z]{2}[0-9]{2}[A-Z0-9]{10,30}$")}),
            obj({"type": {"const": "paypal"}, "email": EMAIL})]}}),
                   "How did the customer pay? 'Charged to my Visa ending in 4242.'"),
        SchemaCase("product_catalog_entry", obj({
            "sku": string(pattern=r"^[A-Z0-9]{6,10}$"), "name": NAME,
            "price": obj({"amount": number(0, 100000), "currency": CURRENCY}), "in_stock": BOOL,
            "variants": array(obj({"size": enum("XS", "S", "M", "L", "XL"), "color": string(20)}), 0, 3),
            "dimensions_cm": obj({"width": number(0), "height": number(0), "depth": number(0)})},
            optional=("dimensions_cm",)),
                   "Write a catalog entry for the cotton T-shirt TSHIRT01, 19.99 USD, in stock in sizes S and M, "
                   "colors white and navy."),
        SchemaCase("shopping_list", obj({"items": array(string(40), 1, 10)}),
                   "Turn this into a shopping list: we need eggs, milk, two loaves of bread and some apples."),
        SchemaCase("bank_transaction", obj({
            "transaction_id": string(pattern=r"^[A-Z0-9]{8,16}$"), "amount": number(0),
            "currency": CURRENCY, "direction": enum("credit", "debit"), "counterparty": NAME,
            "booked_at": string(format="date-time"),
            "category": nullable(enum("groceries", "rent", "salary", "travel", "utilities", "other"))}),
                   "Parse this bank line: TX 8F3K20LQ 2026-02-14T09:30:00Z DEBIT 84.20 EUR REWE Markt."),
        SchemaCase("nutrition_facts", obj({
            "calories": integer(0, 5000), "protein_g": number(0, 500), "carbs_g": number(0, 500),
            "fat_g": number(0, 500), "allergens": array(enum("gluten", "milk", "eggs", "nuts", "soy", "fish"), 0, 6)}),
                   "Give the nutrition facts of one slice of cheese pizza as JSON."),
        SchemaCase("real_estate_listing", {**obj({
            "address": {"$ref": "#/$defs/address"}, "kind": enum("apartment", "house", "townhouse", "studio"),
            "bedrooms": integer(0, 10), "bathrooms": number(0, 10), "price": integer(0),
            "amenities": array(string(30), 0, 5)}), "$defs": {"address": ADDRESS}},
                   "List this property: a 2-bedroom, 1-bathroom apartment at 5 Rue Cler, Paris 75007, FR, with a "
                   "balcony and an elevator, for 650000."),
        SchemaCase("stock_quote", obj({"ticker": string(pattern=r"^[A-Z]{1,5}$"),
                                       "price": {"type": "number", "exclusiveMinimum": 0},
                                       "change_pct": number(-100, 1000), "as_of": string(format="date-time")}),
                   "Quote: NVDA closed at 131.26, up 2.4%, on 2026-01-20 at 21:00 UTC."),
    )


def _cases_time_and_place() -> tuple[SchemaCase, ...]:
    hhmm = string(pattern=r"^([01][0-9]|2[0-3]):[0-5][0-9]$")
    return (
        SchemaCase("event", obj({"title": NAME, "date": DATE, "start_time": string(format="time"),
                                 "location": NAME, "attendees": array(NAME, 0, 6)}),
                   "Extract the event: Team offsite on 2026-05-12 starting 09:00:00Z at the Lakeside Lodge with "
                   "Ana, Ben and Chloe."),
        SchemaCase("address", ADDRESS,
                   "Normalize this address: 221B Baker Street, London, NW1 6XE, United Kingdom."),
        SchemaCase("weather_report", obj({"city": string(40), "temperature_c": number(-60, 60),
                                          "conditions": enum("sunny", "cloudy", "rain", "snow", "storm", "fog"),
                                          "humidity_pct": integer(0, 100), "wind_kph": number(0, 400)},
                                         optional=("wind_kph",)),
                   "Report the weather: Oslo, 3 degrees, light snow, humidity 80%."),
        SchemaCase("flight_booking", obj({"origin": string(pattern=r"^[A-Z]{3}$"),
                                          "destination": string(pattern=r"^[A-Z]{3}$"),
                                          "departure": string(format="date-time"), "passengers": integer(1, 9),
                                          "cabin": enum("economy", "premium_economy", "business", "first")}),
                   "Book: two people flying economy from JFK to LHR on 2026-07-04, leaving at 18:30 UTC."),
        SchemaCase("calendar_slots", obj({"date": DATE, "slots": array(obj({"start": hhmm, "end": hhmm}), 0, 4)}),
                   "When am I free on 2026-04-02? I have meetings 09:00-10:00 and 13:00-14:30; the day is "
                   "08:00-17:00."),
        SchemaCase("geo_point", obj({"lat": number(-90, 90), "lon": number(-180, 180), "label": string(60)},
                                    optional=("label",)),
                   "Give the coordinates of the Eiffel Tower."),
        SchemaCase("date_range", obj({"start": DATE, "end": DATE,
                                      "timezone": enum("UTC", "Europe/Berlin", "America/New_York", "Asia/Tokyo")}),
                   "The conference runs from March 3 to March 6, 2026, Berlin time. Give the date range."),
        SchemaCase("travel_itinerary", obj({"days": array(obj({"day": integer(1, 14), "city": string(40),
                                                               "activities": array(string(60), 1, 3)}), 1, 4)}),
                   "Plan a 3-day trip to Kyoto and Osaka with one or two activities a day."),
        SchemaCase("flight_status", obj({"flight": string(pattern=r"^[A-Z0-9]{2}[0-9]{1,4}$"),
                                         "status": enum("scheduled", "boarding", "departed", "delayed", "cancelled",
                                                        "landed"), "delay_minutes": nullable(integer(0, 1440)),
                                         "gate": nullable(string(pattern=r"^[A-Z]?[0-9]{1,3}$"))}),
                   "Status of LH400: delayed by 45 minutes, departing from gate B22."),
    )


def _cases_work() -> tuple[SchemaCase, ...]:
    return (
        SchemaCase("task_list", obj({"tasks": array(obj({"title": string(80), "done": BOOL,
                                                         "priority": enum("low", "medium", "high"),
                                                         "due": nullable(DATE)}), 1, 5)}),
                   "Make a task list: finish the report by 2026-02-10 (urgent), call the plumber, and the "
                   "groceries are already done."),
        SchemaCase("support_ticket", obj({
            "subject": string(80), "category": enum("billing", "technical", "account", "shipping", "other"),
            "urgency": integer(1, 5), "customer_id": string(pattern=r"^C[0-9]{5,8}$"),
            # No uniqueItems (pydantic's set[str]): llguidance refuses it as unimplemented, the engine answers 400.
            "tags": array(string(20), 0, 4)}),
                   "Triage this ticket from customer C004521: 'I was charged twice for my subscription this "
                   "month, please refund one charge ASAP.'"),
        SchemaCase("job_posting", obj({
            "title": NAME, "company": NAME, "location": string(40), "remote": BOOL,
            "salary": obj({"min": integer(0), "max": integer(0), "currency": CURRENCY}),
            "skills": array(string(30), 1, 6)}),
                   "Extract the job: Acme Corp is hiring a remote Senior Data Engineer (Berlin) paying 80,000 to "
                   "100,000 EUR; Spark, SQL and Airflow required."),
        SchemaCase("meeting_summary", obj({
            "title": NAME, "date": DATE, "participants": array(string(40), 1, 8),
            "decisions": array(string(120), 0, 4),
            "action_items": array(obj({"owner": string(40), "task": string(120), "due": DATE},
                                      optional=("due",)), 0, 4)}),
                   "Summarize: In the 2026-01-15 roadmap meeting, Priya, Tom and Lee agreed to ship v2 in March. "
                   "Tom will write the release notes by 2026-02-20."),
        SchemaCase("email_draft", obj({"to": array(EMAIL, 1, 3), "subject": string(80), "body": string(400),
                                       "priority": enum("low", "normal", "high")}),
                   "Draft a short email to sam@example.com asking to move our call to Friday."),
        SchemaCase("api_error", obj({"code": integer(400, 599), "message": string(120),
                                     "details": nullable(obj({"field": string(40), "reason": string(120)}))}),
                   "Describe as an API error: the request was rejected because the 'email' field is not a valid "
                   "address."),
        SchemaCase("log_entry", obj({"timestamp": string(format="date-time"),
                                     "level": enum("DEBUG", "INFO", "WARN", "ERROR"), "service": string(40),
                                     "message": string(200), "request_id": string(format="uuid")}),
                   "Parse: 2026-03-09T12:01:44Z ERROR payments request 3f2b8c1e-9a4d-4c1b-8f0e-2d6a7b9c0e11 "
                   "timed out talking to the bank."),
        SchemaCase("server_config", obj({"hostname": string(format="hostname"), "ip": string(format="ipv4"),
                                         "port": integer(1, 65535), "tls": BOOL,
                                         "timeouts_s": obj({"connect": number(0, 600), "read": number(0, 600)})}),
                   "Write the config for api.internal.example.com at 10.0.4.17, port 8443 with TLS, connect "
                   "timeout 5 s, read timeout 30 s."),
        SchemaCase("git_commit", obj({"type": enum("feat", "fix", "docs", "refactor", "test", "chore"),
                                      "scope": string(pattern=r"^[a-z][a-z0-9-]{0,19}$"),
                                      "subject": string(72), "breaking": BOOL}, optional=("scope",)),
                   "Write a conventional commit for: fixed the crash in the parser when the input is empty."),
        SchemaCase("dns_record", obj({"name": string(format="hostname"),
                                      "type": enum("A", "AAAA", "CNAME", "MX", "TXT"), "ttl": integer(60, 86400),
                                      "value": string(255)}),
                   "Create a DNS record pointing www.example.com to example.com with a one-hour TTL."),
        SchemaCase("sql_filter", obj({"table": enum("users", "orders", "products"), "columns": array(string(30), 1, 5),
                                      "where": nullable(obj({"column": string(30),
                                                             "op": enum("=", "!=", "<", ">", "<=", ">=", "LIKE"),
                                                             "value": {"anyOf": [string(60), {"type": "number"}]}})),
                                      "limit": integer(1, 1000)}),
                   "Turn into a query spec: the names and emails of users older than 30, at most 50 rows."),
        SchemaCase("feature_flags", obj({"dark_mode": BOOL, "beta_search": BOOL, "new_checkout": BOOL,
                                         "rollout_pct": integer(0, 100)}),
                   "Flags for the staging build: dark mode on, beta search off, new checkout on at 25% rollout."),
        SchemaCase("survey_response", obj({"respondent_id": string(format="uuid"),
                                           "answers": array(obj({"question_id": integer(1, 50),
                                                                 "choice": enum("A", "B", "C", "D")}), 1, 5),
                                           "comments": nullable(string(200))}),
                   "Record respondent 0b1c2d3e-4f50-4617-8829-3a4b5c6d7e8f: Q1 A, Q2 C, Q3 B, no comments."),
        SchemaCase("tool_call", obj({"name": enum("get_weather", "search_web", "send_email"),
                                     "arguments": obj({"query": string(120), "city": string(40),
                                                       "to": EMAIL}, optional=("query", "city", "to"))}),
                   "Which tool should be called, and with what arguments, to answer: what's the weather in Rome?"),
    )


def _cases_knowledge() -> tuple[SchemaCase, ...]:
    return (
        SchemaCase("sentiment", obj({"label": enum("positive", "neutral", "negative"), "confidence": number(0, 1)}),
                   "Classify the sentiment of: 'The delivery was late again and nobody answered my calls.'"),
        SchemaCase("topic_labels", obj({"labels": array(enum("politics", "sports", "technology", "health",
                                                             "business", "science"), 1, 3)}),
                   "Label the topics of this headline: 'Chipmaker's shares soar after new AI accelerator launch.'"),
        SchemaCase("recipe", obj({"title": NAME, "servings": integer(1, 12),
                                  "ingredients": array(obj({"name": string(40), "quantity": string(20)}), 1, 8),
                                  "steps": array(string(160), 1, 6)}),
                   "Give me a simple recipe for pancakes for four people."),
        SchemaCase("movie", obj({"title": NAME, "year": integer(1900, 2030),
                                 "genres": array(enum("action", "comedy", "drama", "sci-fi", "horror", "romance",
                                                      "animation"), 1, 3),
                                 "rating": number(0, 10), "director": NAME}),
                   "Describe the movie Inception as JSON."),
        SchemaCase("book", obj({"title": NAME, "author": NAME, "isbn": string(pattern=r"^97[89][0-9]{10}$"),
                                "published": DATE, "pages": integer(1, 5000)}),
                   "Catalog this book: 'The Pragmatic Programmer' by David Thomas and Andrew Hunt, ISBN "
                   "9780135957059, published 2019-09-13, 352 pages."),
        SchemaCase("math_answer", obj({"steps": array(string(120), 1, 5), "answer": {"type": "number"}}),
                   "What is 17 times 24? Show your steps."),
        SchemaCase("yes_no_reason", obj({"answer": BOOL, "reason": string(120)}),
                   "Is the Pacific the largest ocean on Earth? Answer with a reason."),
        SchemaCase("translation", obj({"source_lang": enum("en", "fr", "de", "es", "it"),
                                       "target_lang": enum("en", "fr", "de", "es", "it"), "text": string(200)}),
                   "Translate 'Good morning, how are you?' into French."),
        SchemaCase("quiz_question", obj({"question": string(160), "options": array(string(60), 4, 4),
                                         "correct_index": integer(0, 3), "explanation": string(200)}),
                   "Write one multiple-choice question about the capital of Australia."),
        SchemaCase("color_palette", obj({"name": string(40),
                                         "colors": array(string(pattern=r"^#[0-9a-fA-F]{6}$"), 3, 5)}),
                   "Suggest a calm ocean-themed color palette."),
        SchemaCase("shape", obj({"shape": {"anyOf": [
            obj({"kind": {"const": "circle"}, "radius": number(0)}),
            obj({"kind": {"const": "rectangle"}, "width": number(0), "height": number(0)}),
            obj({"kind": {"const": "triangle"}, "a": number(0), "b": number(0), "c": number(0)})]}}),
                   "Describe as a shape: a rectangle 3 meters wide and 2 meters high."),
        SchemaCase("chess_move", obj({"from": string(pattern=r"^[a-h][1-8]$"), "to": string(pattern=r"^[a-h][1-8]$"),
                                      "piece": enum("king", "queen", "rook", "bishop", "knight", "pawn"),
                                      "capture": BOOL}),
                   "Give white's most common first move in chess."),
        SchemaCase("vehicle", obj({"make": string(30), "model": string(30), "year": integer(1950, 2030),
                                   "fuel": enum("petrol", "diesel", "electric", "hybrid"), "mileage_km": integer(0),
                                   "features": array(string(30), 0, 5)}, optional=("features",)),
                   "List the car: 2021 Tesla Model 3, electric, 42,000 km, with autopilot and heated seats."),
        SchemaCase("playlist", obj({"name": string(40), "tracks": array(obj({
            "title": NAME, "artist": NAME, "duration_s": integer(30, 900)}), 1, 5)}),
                   "Make a short road-trip playlist of classic rock songs."),
        SchemaCase("sports_score", obj({"home_team": string(40), "away_team": string(40),
                                        "home_score": integer(0, 200), "away_score": integer(0, 200),
                                        "status": enum("scheduled", "live", "final"), "date": DATE}),
                   "Record the result: on 2026-02-08 the Eagles beat the Chiefs 40 to 22 at home."),
        SchemaCase("sentence_rewrite", obj({"original": string(200), "rewritten": string(200),
                                            "changes": array(string(80), 0, 4)}),
                   "Rewrite more formally: 'hey, can u send me the file asap?'"),
        SchemaCase("key_value_tags", {"type": "object", "additionalProperties": string(30), "maxProperties": 5},
                   "Give up to five key/value tags describing a photo of a red bicycle by a canal in Amsterdam."),
        SchemaCase("coordinates_tuple", obj({"point": {"type": "array", "prefixItems": [number(-90, 90),
                                                                                        number(-180, 180)],
                                                       "items": False, "minItems": 2}}),
                   "Give the [latitude, longitude] of Sydney Opera House."),
    )


def _cases_nested() -> tuple[SchemaCase, ...]:
    return (
        SchemaCase("company", obj({
            "company": obj({"name": NAME, "founded": integer(1800, 2026),
                            "headquarters": obj({"city": string(40), "country": string(40)})}),
            "employees": array(obj({"name": NAME, "role": string(40)}), 0, 3)}),
                   "Describe the company: Nordwind GmbH, founded 1998 in Hamburg, Germany; CEO Eva Braun and CTO "
                   "Karl Ortiz."),
        SchemaCase("category_tree", {"$ref": "#/$defs/category", "$defs": {"category": obj({
            "name": string(40), "children": array({"$ref": "#/$defs/category"}, 0, 3)})}},
                   "Make a small category tree: Electronics with Phones and Laptops; Laptops has Gaming."),
        SchemaCase("org_chart", {**obj({"ceo": {"$ref": "#/$defs/employee"}}), "$defs": {"employee": obj({
            "name": NAME, "title": string(40), "reports": array({"$ref": "#/$defs/employee"}, 0, 2)})}},
                   "Draw the org chart: Ana is CEO; Bo (CTO) and Cy (CFO) report to her; Di reports to Bo."),
        SchemaCase("comment_thread", {**obj({"post_id": integer(1), "comments": array({"$ref": "#/$defs/comment"},
                                                                                      0, 3)}),
                                      "$defs": {"author": obj({"handle": string(pattern=r"^@[a-z0-9_]{2,15}$"),
                                                               "verified": BOOL}),
                                                "comment": obj({"author": {"$ref": "#/$defs/author"},
                                                                "text": string(200), "likes": integer(0)})}},
                   "Represent the comments on post 812: @maya says 'great shot!' (3 likes), @tom_k says 'where is "
                   "this?' (0 likes)."),
        SchemaCase("inventory", obj({"warehouse": string(40), "updated": DATE, "stock": array(obj({
            "sku": string(pattern=r"^[A-Z]{2}[0-9]{4}$"), "qty": integer(0, 100000),
            "location": obj({"aisle": integer(1, 99), "shelf": enum("A", "B", "C", "D")})}), 1, 4)}),
                   "Stock report for the Leeds warehouse on 2026-01-31: AB1234 120 units in aisle 4 shelf B, "
                   "CD5678 8 units in aisle 12 shelf A."),
        SchemaCase("medication_schedule", obj({"patient_initials": string(pattern=r"^[A-Z]{2,3}$"),
                                               "medications": array(obj({
                                                   "name": string(40), "dose_mg": number(0, 5000),
                                                   "times": array(string(pattern=r"^([01][0-9]|2[0-3]):[0-5][0-9]$"),
                                                                  1, 4),
                                                   "with_food": BOOL}), 1, 4)}),
                   "Schedule for patient J.D.: ibuprofen 400 mg at 08:00 and 20:00 with food; vitamin D 25 mg at "
                   "08:00."),
    )


def _fixed(keys: list[str], values: dict[str, Any]) -> dict[str, Any]:
    """An object of required keys, each taking `values` (an enum or a boolean)."""
    return obj({k: values for k in keys})


def _cases_fixed_keys() -> tuple[SchemaCase, ...]:
    yes_no = enum("yes", "no", "not_applicable")
    status = enum("operational", "degraded", "outage", "maintenance")
    return (
        SchemaCase("fixed_device_capabilities", _fixed([
            "supports_wifi_six", "supports_bluetooth_low_energy", "supports_near_field_communication",
            "supports_wireless_charging", "has_headphone_jack", "has_expandable_storage", "has_face_unlock",
            "has_fingerprint_sensor", "is_water_resistant", "is_dust_resistant", "ships_with_charger",
            "supports_dual_sim", "supports_satellite_messaging", "supports_stylus_input"], BOOL),
                   "Fill in the capability sheet of a typical 2025 flagship smartphone."),
        SchemaCase("fixed_safety_checklist", _fixed([
            "fire_extinguisher_inspected", "emergency_exits_unobstructed", "first_aid_kit_stocked",
            "smoke_detectors_tested", "evacuation_plan_posted", "electrical_panels_accessible",
            "chemical_storage_labelled", "protective_equipment_available", "spill_kits_available",
            "eyewash_station_working", "ladders_inspected", "machine_guards_in_place",
            "training_records_current", "incident_log_reviewed", "lighting_adequate",
            "ventilation_working"], yes_no),
                   "Complete the monthly safety checklist for a small, well-run woodworking shop."),
        SchemaCase("fixed_service_status", _fixed([
            "authentication_service", "payment_gateway", "order_management", "inventory_service",
            "notification_service", "search_service", "recommendation_engine", "content_delivery_network",
            "primary_database", "replica_database", "message_queue", "object_storage", "analytics_pipeline",
            "customer_support_portal", "public_api_gateway", "internal_admin_console", "billing_service",
            "audit_logging"], status),
                   "Report the status of every service: the payment gateway is degraded, search is under "
                   "maintenance, everything else works."),
        SchemaCase("fixed_country_profile", obj({
            "drives_on_left": BOOL, "uses_metric_system": BOOL, "currency_is_euro": BOOL,
            "is_european_union_member": BOOL, "is_nato_member": BOOL, "is_landlocked": BOOL,
            "has_monarchy": BOOL, "official_language_family": enum("germanic", "romance", "slavic", "other"),
            "predominant_climate": enum("tropical", "dry", "temperate", "continental", "polar"),
            "continent": enum("africa", "asia", "europe", "north_america", "oceania", "south_america"),
            "hemisphere": enum("northern", "southern"), "calling_code_region": enum("one", "two", "three", "four",
                                                                                   "five", "six", "seven",
                                                                                   "eight", "nine")}),
                   "Fill in the country profile of Germany."),
    )


SUITE: tuple[SchemaCase, ...] = (_cases_people() + _cases_commerce() + _cases_time_and_place() + _cases_work()
                                 + _cases_knowledge() + _cases_nested())
FIXED_KEYS: tuple[SchemaCase, ...] = _cases_fixed_keys()
ALL: tuple[SchemaCase, ...] = SUITE + FIXED_KEYS


def by_name(name: str) -> SchemaCase:
    """The case named `name` (ValueError listing none when there is no such case)."""
    for case in ALL:
        if case.name == name:
            return case
    raise ValueError(f"no schema case named {name!r}")
