"""JSON schemas in the shape of real APIs' payloads (nesting, enums, arrays, optional fields,
bounded numbers, string formats), each with a request a user might make for one: the test data
of the structured-output tests and of benchmarks/structured_outputs.py.

Strings and arrays carry the bounds real APIs document (a name of at most 64 characters, at
most 10 tags), so that even a random-weight model's output under the schema ends."""
from __future__ import annotations

from dataclasses import dataclass


def text(max_length: int = 24, min_length: int = 1, **extra) -> dict:
    return {"type": "string", "minLength": min_length, "maxLength": max_length, **extra}


def formatted(format: str) -> dict:
    """A string in a format, of at most 40 characters (an email's length is otherwise unbounded)."""
    return {"type": "string", "format": format, "maxLength": 40}


def integer(minimum: int, maximum: int) -> dict:
    return {"type": "integer", "minimum": minimum, "maximum": maximum}


def number(minimum: float, maximum: float) -> dict:
    return {"type": "number", "minimum": minimum, "maximum": maximum}


def enum(*values) -> dict:
    return {"enum": list(values)}


def array(items: dict, min_items: int = 0, max_items: int = 4) -> dict:
    return {"type": "array", "items": items, "minItems": min_items, "maxItems": max_items}


def obj(required: dict, optional: dict | None = None) -> dict:
    return {"type": "object", "properties": {**required, **(optional or {})}, "required": list(required),
            "additionalProperties": False}


BOOLEAN = {"type": "boolean"}
MONEY = obj({"amount": number(0, 100000), "currency": enum("USD", "EUR", "GBP", "JPY")})
ADDRESS = obj({"street": text(40), "city": text(24), "country": text(2, 2, pattern="^[A-Z]{2}$")},
              {"postal_code": text(10), "region": text(24)})
PERSON = obj({"name": text(40), "email": formatted("email")}, {"phone": text(16, pattern=r"^\+?[0-9 ]{6,15}$")})
GEO = obj({"lat": number(-90, 90), "lon": number(-180, 180)})


@dataclass(frozen=True)
class APISchema:
    name: str
    request: str  # what a user asks for
    schema: dict

    @property
    def prompt(self) -> str:
        return f"{self.request} Answer with JSON only."


SCHEMAS = [
    APISchema("user_profile", "Create a user profile for a new customer.",
              obj({"id": formatted("uuid"), "username": text(20, pattern="^[a-z0-9_]{3,20}$"), "email": formatted("email"),
                   "created_at": formatted("date-time")}, {"bio": text(80), "age": integer(13, 120)})),
    APISchema("postal_address", "Give the shipping address of the Louvre museum.", ADDRESS),
    APISchema("order", "Record an online order of two books.",
              obj({"order_id": text(12), "customer": PERSON, "items": array(obj({
                  "sku": text(12), "quantity": integer(1, 99), "unit_price": MONEY}), 1, 5),
                   "status": enum("pending", "paid", "shipped", "delivered", "cancelled")},
                  {"shipping_address": ADDRESS, "notes": text(60)})),
    APISchema("invoice", "Write an invoice for a month of web hosting.",
              obj({"invoice_number": text(12), "issued": formatted("date"), "due": formatted("date"),
                   "lines": array(obj({"description": text(40), "amount": MONEY}), 1, 4), "total": MONEY,
                   "paid": BOOLEAN})),
    APISchema("weather_report", "Report the current weather in Tokyo.",
              obj({"city": text(24), "temperature_c": number(-60, 60), "humidity": integer(0, 100),
                   "conditions": enum("clear", "clouds", "rain", "snow", "storm", "fog")},
                  {"wind_kph": number(0, 300), "alerts": array(text(40), 0, 3)})),
    APISchema("calendar_event", "Schedule a team meeting next Monday at 10.",
              obj({"title": text(40), "start": formatted("date-time"), "end": formatted("date-time"),
                   "attendees": array(formatted("email"), 1, 5)},
                  {"location": text(40), "recurrence": enum("none", "daily", "weekly", "monthly"),
                   "reminder_minutes": integer(0, 1440)})),
    APISchema("github_issue", "File a bug report about a crash on startup.",
              obj({"title": text(60), "body": text(120), "labels": array(enum("bug", "enhancement", "question",
                                                                                "documentation", "good first issue"), 0, 3),
                   "state": enum("open", "closed")}, {"assignees": array(text(20), 0, 2), "milestone": integer(1, 50)})),
    APISchema("pull_request", "Describe a pull request that fixes a typo in the README.",
              obj({"title": text(60), "head": text(30), "base": text(30), "draft": BOOLEAN},
                  {"reviewers": array(text(20), 0, 3), "body": text(120)})),
    APISchema("product", "List a wireless mouse in an online shop.",
              obj({"sku": text(12), "name": text(40), "price": MONEY, "in_stock": BOOLEAN,
                   "category": enum("electronics", "books", "clothing", "home", "toys")},
                  {"tags": array(text(16), 0, 5), "weight_kg": number(0, 1000), "rating": number(0, 5)})),
    APISchema("product_review", "Review a coffee grinder you bought.",
              obj({"product_id": text(12), "stars": integer(1, 5), "title": text(40), "verified_purchase": BOOLEAN},
                  {"pros": array(text(30), 0, 3), "cons": array(text(30), 0, 3)})),
    APISchema("payment", "Record a card payment of 25 euros.",
              obj({"payment_id": formatted("uuid"), "amount": MONEY,
                   "method": enum("card", "bank_transfer", "paypal", "cash"),
                   "status": enum("authorized", "captured", "refunded", "failed")},
                  {"card_last4": text(4, 4, pattern="^[0-9]{4}$"), "captured_at": formatted("date-time")})),
    APISchema("shipment_tracking", "Give the tracking status of a parcel.",
              obj({"tracking_number": text(20), "carrier": enum("UPS", "FedEx", "DHL", "USPS"),
                   "events": array(obj({"time": formatted("date-time"), "location": text(24),
                                        "status": enum("label_created", "in_transit", "out_for_delivery",
                                                       "delivered", "exception")}), 1, 4)},
                  {"estimated_delivery": formatted("date")})),
    APISchema("flight_booking", "Book a flight from Paris to New York.",
              obj({"booking_reference": text(6, 6, pattern="^[A-Z0-9]{6}$"),
                   "passengers": array(obj({"first_name": text(20), "last_name": text(20)},
                                           {"seat": text(4, pattern="^[0-9]{1,2}[A-K]$")}), 1, 3),
                   "segments": array(obj({"from": text(3, 3, pattern="^[A-Z]{3}$"), "to": text(3, 3, pattern="^[A-Z]{3}$"),
                                          "departure": formatted("date-time"), "flight_number": text(7)}), 1, 3),
                   "cabin": enum("economy", "premium_economy", "business", "first")})),
    APISchema("hotel_reservation", "Reserve a hotel room in Rome for three nights.",
              obj({"hotel": text(40), "check_in": formatted("date"), "check_out": formatted("date"),
                   "guests": integer(1, 8), "room_type": enum("single", "double", "suite")},
                  {"breakfast": BOOLEAN, "special_requests": text(60)})),
    APISchema("restaurant", "Describe a neighbourhood pizzeria.",
              obj({"name": text(40), "cuisine": enum("italian", "japanese", "mexican", "indian", "french", "other"),
                   "price_level": integer(1, 4), "location": GEO},
                  {"opening_hours": array(obj({"day": enum("mon", "tue", "wed", "thu", "fri", "sat", "sun"),
                                               "open": text(5, 5, pattern="^[0-2][0-9]:[0-5][0-9]$"),
                                               "close": text(5, 5, pattern="^[0-2][0-9]:[0-5][0-9]$")}), 0, 7)})),
    APISchema("recipe", "Give a recipe for pancakes.",
              obj({"title": text(40), "servings": integer(1, 12),
                   "ingredients": array(obj({"name": text(24), "quantity": number(0, 1000),
                                             "unit": enum("g", "ml", "cup", "tbsp", "tsp", "piece")}), 1, 6),
                   "steps": array(text(60), 1, 5)}, {"prep_minutes": integer(0, 600), "vegetarian": BOOLEAN})),
    APISchema("movie", "Describe the film Casablanca.",
              obj({"title": text(40), "year": integer(1888, 2030), "genres": array(enum(
                  "drama", "comedy", "action", "romance", "thriller", "documentary"), 1, 3)},
                  {"director": text(40), "runtime_minutes": integer(1, 600), "rating": number(0, 10)})),
    APISchema("book", "Catalogue the novel Moby-Dick.",
              obj({"isbn": text(13, 10, pattern="^[0-9]{10,13}$"), "title": text(60), "authors": array(text(40), 1, 3)},
                  {"published": formatted("date"), "pages": integer(1, 5000), "language": text(2, 2)})),
    APISchema("song", "Describe a jazz standard.",
              obj({"title": text(40), "artist": text(40), "duration_s": integer(1, 3600)},
                  {"album": text(40), "explicit": BOOLEAN, "bpm": integer(20, 300)})),
    APISchema("playlist", "Make a short running playlist.",
              obj({"name": text(30), "public": BOOLEAN, "tracks": array(obj({"title": text(30), "artist": text(30)}), 1, 4)},
                  {"description": text(60)})),
    APISchema("employee", "Add a software engineer to the HR system.",
              obj({"employee_id": integer(1, 999999), "name": text(40), "email": formatted("email"),
                   "department": enum("engineering", "sales", "marketing", "finance", "hr"),
                   "start_date": formatted("date")}, {"manager_id": integer(1, 999999), "salary": MONEY})),
    APISchema("job_posting", "Post a job opening for a data analyst.",
              obj({"title": text(40), "company": text(40), "employment_type": enum("full_time", "part_time",
                                                                                   "contract", "internship"),
                   "remote": BOOLEAN, "skills": array(text(20), 1, 5)},
                  {"salary_range": obj({"min": integer(0, 1000000), "max": integer(0, 1000000)}),
                   "location": text(30)})),
    APISchema("resume", "Summarize a junior developer's CV.",
              obj({"name": text(40), "experience": array(obj({"company": text(30), "role": text(30),
                                                              "start": formatted("date")}, {"end": formatted("date")}), 0, 3),
                   "education": array(obj({"school": text(40), "degree": enum("bsc", "msc", "phd", "other")}), 0, 2)},
                  {"skills": array(text(20), 0, 6)})),
    APISchema("medical_appointment", "Book a dentist appointment.",
              obj({"patient_id": text(10), "provider": text(40), "time": formatted("date-time"),
                   "type": enum("checkup", "cleaning", "filling", "consultation")},
                  {"notes": text(80), "insurance": BOOLEAN})),
    APISchema("prescription", "Write a prescription record for an antibiotic.",
              obj({"drug": text(30), "dose_mg": number(0, 5000), "frequency_per_day": integer(1, 6),
                   "days": integer(1, 90)}, {"refills": integer(0, 5), "with_food": BOOLEAN})),
    APISchema("bank_transaction", "Record a grocery purchase on a bank account.",
              obj({"transaction_id": formatted("uuid"), "account": text(34), "amount": MONEY,
                   "direction": enum("debit", "credit"), "booked_at": formatted("date-time")},
                  {"merchant": text(40), "category": enum("groceries", "rent", "salary", "transport", "other")})),
    APISchema("stock_quote", "Quote the current price of a tech stock.",
              obj({"symbol": text(5, 1, pattern="^[A-Z]{1,5}$"), "price": number(0, 100000), "change_pct": number(-100, 100),
                   "exchange": enum("NYSE", "NASDAQ", "LSE", "TSE")}, {"volume": integer(0, 10 ** 9)})),
    APISchema("crypto_price", "Give the price of bitcoin in several currencies.",
              obj({"asset": enum("BTC", "ETH", "SOL"), "prices": array(obj({"currency": enum("USD", "EUR", "GBP"),
                                                                            "price": number(0, 10 ** 6)}), 1, 3),
                   "as_of": formatted("date-time")})),
    APISchema("sensor_reading", "Report a reading from a greenhouse sensor.",
              obj({"device_id": text(16), "timestamp": formatted("date-time"),
                   "metrics": obj({"temperature_c": number(-40, 85)}, {"humidity": number(0, 100),
                                                                        "co2_ppm": integer(0, 10000)})},
                  {"battery_pct": integer(0, 100)})),
    APISchema("log_entry", "Write a structured log line for a failed login.",
              obj({"timestamp": formatted("date-time"), "level": enum("debug", "info", "warning", "error", "critical"),
                   "message": text(80), "service": text(24)}, {"user_id": integer(1, 10 ** 6), "ip": formatted("ipv4")})),
    APISchema("error_report", "Report an exception from a web app.",
              obj({"error_type": text(30), "message": text(80), "stack": array(obj({"file": text(40), "line": integer(1, 100000),
                                                                                    "function": text(30)}), 1, 4)},
                  {"handled": BOOLEAN, "release": text(16)})),
    APISchema("http_request", "Describe an HTTP request that creates a user.",
              obj({"method": enum("GET", "POST", "PUT", "PATCH", "DELETE"), "path": text(40, pattern="^/.*$"),
                   "headers": array(obj({"name": text(24), "value": text(40)}), 0, 4)},
                  {"body": text(80), "timeout_s": number(0, 600)})),
    APISchema("dns_record", "Add a DNS record pointing a domain to a server.",
              obj({"name": text(40), "type": enum("A", "AAAA", "CNAME", "MX", "TXT"), "value": text(60),
                   "ttl": integer(60, 86400)}, {"priority": integer(0, 65535)})),
    APISchema("container", "Describe a container running a web server.",
              obj({"name": text(30), "image": text(40), "ports": array(obj({"container_port": integer(1, 65535),
                                                                             "protocol": enum("TCP", "UDP")}), 0, 3),
                   "env": array(obj({"name": text(24, pattern="^[A-Z_][A-Z0-9_]*$"), "value": text(40)}), 0, 3)},
                  {"cpu_limit": number(0, 64), "memory_mb": integer(16, 65536), "restart": enum("always", "on-failure", "no")})),
    APISchema("ci_job", "Describe a CI job that runs the test suite.",
              obj({"name": text(30), "runs_on": enum("ubuntu-latest", "windows-latest", "macos-latest"),
                   "steps": array(obj({"name": text(30)}, {"run": text(60), "uses": text(40)}), 1, 4)},
                  {"timeout_minutes": integer(1, 360), "needs": array(text(30), 0, 2)})),
    APISchema("test_result", "Summarize a test run.",
              obj({"suite": text(30), "passed": integer(0, 10000), "failed": integer(0, 10000), "duration_s": number(0, 86400),
                   "failures": array(obj({"test": text(40), "message": text(60)}), 0, 3)})),
    APISchema("feature_flag", "Define a feature flag for a new checkout page.",
              obj({"key": text(30, pattern="^[a-z0-9-]+$"), "enabled": BOOLEAN, "rollout_pct": integer(0, 100)},
                  {"segments": array(enum("beta", "staff", "eu", "us", "mobile"), 0, 3), "expires": formatted("date")})),
    APISchema("experiment", "Report the results of an A/B test on a button colour.",
              obj({"name": text(30), "variants": array(obj({"name": text(16), "users": integer(0, 10 ** 7),
                                                            "conversion_rate": number(0, 1)}), 2, 3),
                   "winner": text(16)}, {"p_value": number(0, 1)})),
    APISchema("survey_response", "Fill in a customer satisfaction survey.",
              obj({"respondent_id": text(12), "answers": array(obj({"question_id": integer(1, 100),
                                                                    "score": integer(1, 10)}, {"comment": text(60)}), 1, 5)},
                  {"would_recommend": BOOLEAN})),
    APISchema("quiz_question", "Write a multiple-choice question about the solar system.",
              obj({"question": text(80), "options": array(text(30), 2, 4), "answer_index": integer(0, 3),
                   "difficulty": enum("easy", "medium", "hard")})),
    APISchema("sentiment", "Classify the sentiment of the review 'Great battery, awful screen.'",
              obj({"label": enum("positive", "negative", "neutral", "mixed"), "confidence": number(0, 1)},
                  {"aspects": array(obj({"aspect": text(20), "label": enum("positive", "negative", "neutral")}), 0, 3)})),
    APISchema("named_entities", "Extract the entities from 'Ada Lovelace worked with Babbage in London.'",
              obj({"entities": array(obj({"text": text(30), "type": enum("PERSON", "ORG", "LOCATION", "DATE", "OTHER"),
                                          "start": integer(0, 1000)}), 0, 5)})),
    APISchema("translation", "Translate 'good morning' into French and Spanish.",
              obj({"source_language": text(2, 2), "translations": array(obj({"language": text(2, 2),
                                                                             "text": text(40)}), 1, 3)})),
    APISchema("summary", "Summarize a news article about a new bridge.",
              obj({"headline": text(60), "key_points": array(text(60), 1, 3), "word_count": integer(1, 5000)},
                  {"topics": array(text(16), 0, 3)})),
    APISchema("classification", "Route a support email to a team.",
              obj({"team": enum("billing", "technical", "sales", "general"), "priority": enum("low", "normal", "high",
                                                                                             "urgent"),
                   "spam": BOOLEAN})),
    APISchema("search_query", "Turn 'cheap flights to Lisbon in May' into a search query.",
              obj({"query": text(60), "filters": obj({}, {"max_price": integer(0, 10000), "month": integer(1, 12),
                                                          "destination": text(24)}),
                   "sort": enum("relevance", "price_asc", "price_desc", "date")}, {"page": integer(1, 100)})),
    APISchema("geocode", "Geocode the address of the Eiffel Tower.",
              obj({"query": text(60), "results": array(obj({"formatted_address": text(80), "location": GEO,
                                                            "confidence": number(0, 1)}), 0, 2)})),
    APISchema("directions", "Give walking directions between two landmarks.",
              obj({"mode": enum("walking", "driving", "cycling", "transit"), "distance_m": integer(0, 10 ** 7),
                   "duration_s": integer(0, 10 ** 6), "steps": array(obj({"instruction": text(60),
                                                                          "distance_m": integer(0, 100000)}), 1, 4)})),
    APISchema("email_message", "Draft an email inviting a colleague to lunch.",
              obj({"to": array(formatted("email"), 1, 3), "subject": text(60), "body": text(160)},
                  {"cc": array(formatted("email"), 0, 2), "priority": enum("low", "normal", "high")})),
    APISchema("sms", "Write a text message confirming a delivery slot.",
              obj({"to": text(16, pattern=r"^\+[0-9]{7,15}$"), "body": text(160)}, {"send_at": formatted("date-time")})),
    APISchema("notification", "Create a push notification about a price drop.",
              obj({"title": text(40), "body": text(100), "channel": enum("push", "email", "sms", "in_app")},
                  {"deep_link": text(60), "badge": integer(0, 99), "silent": BOOLEAN})),
    APISchema("availability", "Give a doctor's free slots on Friday.",
              obj({"date": formatted("date"), "slots": array(obj({"start": text(5, 5, pattern="^[0-2][0-9]:[0-5][0-9]$"),
                                                                  "minutes": enum(15, 30, 60)}), 0, 5)})),
    APISchema("support_ticket", "Open a support ticket for a broken login page.",
              obj({"subject": text(60), "requester": PERSON, "priority": enum("low", "normal", "high", "urgent"),
                   "status": enum("new", "open", "pending", "solved")}, {"tags": array(text(16), 0, 4)})),
    APISchema("insurance_claim", "File a car insurance claim after a minor accident.",
              obj({"policy_number": text(12), "incident_date": formatted("date"), "description": text(120),
                   "claimed": MONEY, "vehicle": obj({"make": text(20), "model": text(20), "year": integer(1950, 2030)})},
                  {"police_report": BOOLEAN})),
    APISchema("real_estate_listing", "List a two-bedroom flat for rent.",
              obj({"title": text(60), "price": MONEY, "bedrooms": integer(0, 20), "bathrooms": number(0, 20),
                   "address": ADDRESS}, {"area_m2": number(5, 10000), "furnished": BOOLEAN,
                                         "amenities": array(enum("parking", "elevator", "balcony", "garden", "pool"), 0, 4)})),
    APISchema("car_listing", "Sell a used hatchback.",
              obj({"make": text(20), "model": text(20), "year": integer(1950, 2030), "mileage_km": integer(0, 10 ** 6),
                   "fuel": enum("petrol", "diesel", "hybrid", "electric"), "price": MONEY},
                  {"color": text(16), "accident_free": BOOLEAN})),
    APISchema("match_score", "Report the score of a football match.",
              obj({"home": text(30), "away": text(30), "home_goals": integer(0, 30), "away_goals": integer(0, 30),
                   "status": enum("scheduled", "live", "finished")},
                  {"scorers": array(obj({"player": text(30), "minute": integer(1, 130)}), 0, 5)})),
    APISchema("event_registration", "Register an attendee for a conference.",
              obj({"event_id": text(12), "attendee": PERSON, "ticket": enum("standard", "student", "vip"),
                   "workshops": array(text(30), 0, 3)}, {"dietary": enum("none", "vegetarian", "vegan", "gluten_free")})),
    APISchema("tax_form", "Fill in the summary of a simple tax return.",
              obj({"year": integer(2000, 2030), "filing_status": enum("single", "married_joint", "married_separate",
                                                                      "head_of_household"),
                   "income": MONEY, "deductions": array(obj({"kind": text(24), "amount": MONEY}), 0, 3)},
                  {"refund_expected": BOOLEAN})),
]

TOOLS = [  # functions for tool calls, in OpenAI's form, with the same schemas' shapes
    {"type": "function", "function": {"name": s.name,
                                      "description": s.request, "parameters": s.schema}}
    for s in SCHEMAS[:12]
]
