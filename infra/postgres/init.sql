-- A team's PostgreSQL for vip: one role, one database for Prefect and one for MLflow.
-- psql -h DB_HOST -U postgres -v password="'a long secret'" -f infra/postgres/init.sql
CREATE ROLE vip LOGIN PASSWORD :password;
CREATE DATABASE prefect OWNER vip;
CREATE DATABASE mlflow OWNER vip;
