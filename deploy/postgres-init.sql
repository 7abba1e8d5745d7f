-- One database per service on the one server (the orders database is POSTGRES_DB).
CREATE DATABASE inventory OWNER app;
CREATE DATABASE ledger OWNER app;
CREATE DATABASE loyalty OWNER app;
