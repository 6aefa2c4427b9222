"""Pydantic models for some of the schema suite's cases (trtprompt/bench/schemas.py), written the way
applications write them, for the official openai client's `chat.completions.parse(response_format=Model)`
(scripts/compat/schema_suite.py). Each model's key in MODELS is the suite case whose prompt it is sent with;
the schema the client sends is the client's own conversion of the model (strict: every field required,
Optional fields nullable, additionalProperties false), not the case's hand-written schema.
"""

from __future__ import annotations

import datetime
import ipaddress
import uuid
from typing import Annotated, Literal, Optional, Union

from pydantic import AnyUrl, BaseModel, Field

Name = Annotated[str, Field(max_length=60)]
Email = Annotated[str, Field(pattern=r"^[^@\s]+@[^@\s]+\.[a-z]{2,}$", max_length=80)]
Currency = Literal["USD", "EUR", "GBP", "JPY"]


class PersonBasic(BaseModel):
    name: Name
    age: int = Field(ge=0, le=130)
    is_student: bool


class ContactCard(BaseModel):
    name: Name
    email: Email
    phone: str = Field(pattern=r"^\+?[0-9 ()-]{7,20}$")
    website: Optional[AnyUrl] = None


class Customer(BaseModel):
    name: Name
    email: Email


class OrderItem(BaseModel):
    sku: str = Field(pattern=r"^[A-Z]{2,4}-[0-9]{3,6}$")
    quantity: int = Field(ge=1, le=100)
    unit_price: float = Field(ge=0, le=10000)


class OrderDetails(BaseModel):
    order_id: str = Field(pattern=r"^ORD-[0-9]{4,8}$")
    customer: Customer
    items: list[OrderItem] = Field(min_length=1, max_length=5)
    status: Literal["pending", "paid", "shipped", "delivered", "cancelled"]


class LineItem(BaseModel):
    description: str = Field(max_length=80)
    amount: float = Field(ge=0)


class Invoice(BaseModel):
    invoice_number: str = Field(pattern=r"^INV-[0-9]{3,8}$")
    issue_date: datetime.date
    due_date: datetime.date
    currency: Currency
    line_items: list[LineItem] = Field(min_length=1, max_length=4)
    total: float = Field(ge=0)


class ProductReview(BaseModel):
    product: Name
    rating: int = Field(ge=1, le=5)
    sentiment: Literal["positive", "neutral", "negative"]
    pros: list[Annotated[str, Field(max_length=60)]] = Field(max_length=3)
    cons: list[Annotated[str, Field(max_length=60)]] = Field(max_length=3)


class Card(BaseModel):
    type: Literal["card"]
    brand: Literal["visa", "mastercard", "amex"]
    last4: str = Field(pattern=r"^[0-9]{4}$")


class BankTransfer(BaseModel):
    type: Literal["bank_transfer"]
    iban: str = Field(pattern=r"^[A-Z]{2}[0-9]{2}[A-Z0-9]{10,30}$")


class PayPal(BaseModel):
    type: Literal["paypal"]
    email: Email


class PaymentMethod(BaseModel):
    payment: Union[Card, BankTransfer, PayPal]


class Event(BaseModel):
    title: Name
    date: datetime.date
    start_time: datetime.time
    location: Name
    attendees: list[Name] = Field(max_length=6)


class FlightBooking(BaseModel):
    origin: str = Field(pattern=r"^[A-Z]{3}$")
    destination: str = Field(pattern=r"^[A-Z]{3}$")
    departure: datetime.datetime
    passengers: int = Field(ge=1, le=9)
    cabin: Literal["economy", "premium_economy", "business", "first"]


class Task(BaseModel):
    title: str = Field(max_length=80)
    done: bool
    priority: Literal["low", "medium", "high"]
    due: Optional[datetime.date]


class TaskList(BaseModel):
    tasks: list[Task] = Field(min_length=1, max_length=5)


class LogEntry(BaseModel):
    timestamp: datetime.datetime
    level: Literal["DEBUG", "INFO", "WARN", "ERROR"]
    service: str = Field(max_length=40)
    message: str = Field(max_length=200)
    request_id: uuid.UUID


class Timeouts(BaseModel):
    connect: float = Field(ge=0, le=600)
    read: float = Field(ge=0, le=600)


class ServerConfig(BaseModel):
    hostname: str = Field(max_length=253)
    ip: ipaddress.IPv4Address
    port: int = Field(ge=1, le=65535)
    tls: bool
    timeouts_s: Timeouts


class Movie(BaseModel):
    title: Name
    year: int = Field(ge=1900, le=2030)
    genres: list[Literal["action", "comedy", "drama", "sci-fi", "horror", "romance", "animation"]] = \
        Field(min_length=1, max_length=3)
    rating: float = Field(ge=0, le=10)
    director: Name


class Category(BaseModel):
    name: str = Field(max_length=40)
    children: list[Category] = Field(max_length=3)


class Sentiment(BaseModel):
    label: Literal["positive", "neutral", "negative"]
    confidence: float = Field(ge=0, le=1)


# suite case name -> the model sent with that case's prompt
MODELS: dict[str, type[BaseModel]] = {
    "person_basic": PersonBasic, "contact_card": ContactCard, "order_details": OrderDetails,
    "invoice": Invoice, "product_review": ProductReview, "payment_method": PaymentMethod, "event": Event,
    "flight_booking": FlightBooking, "task_list": TaskList, "log_entry": LogEntry,
    "server_config": ServerConfig, "movie": Movie, "category_tree": Category, "sentiment": Sentiment,
}
