using Microsoft.Extensions.Options;

namespace ExactlyOnce;

/// <summary>Validates <see cref="ExactlyOnceOptions"/> at startup, so bad configuration fails before the first message.</summary>
internal sealed class ExactlyOnceOptionsValidator : IValidateOptions<ExactlyOnceOptions>
{
    public ValidateOptionsResult Validate(string? name, ExactlyOnceOptions options)
    {
        var failures = new List<string>();
        if (options.ClaimTimeout <= TimeSpan.Zero || options.ClaimTimeout > TimeSpan.FromHours(1))
        {
            failures.Add($"ClaimTimeout must be greater than zero and at most one hour (was {options.ClaimTimeout}).");
        }
        else if (options.ClaimTimeout < TimeSpan.FromMilliseconds(1))
        {
            failures.Add("ClaimTimeout must be at least one millisecond.");
        }

        if (options.InboxRetention <= TimeSpan.Zero)
        {
            failures.Add($"InboxRetention must be greater than zero (was {options.InboxRetention}).");
        }

        var batching = options.Batching;
        if (batching.MaxBatchSize is < 1 or > 64)
        {
            failures.Add($"Batching.MaxBatchSize must be between 1 and 64 (was {batching.MaxBatchSize}).");
        }

        if (batching.MaxWait < TimeSpan.Zero || batching.MaxWait > TimeSpan.FromSeconds(1))
        {
            failures.Add($"Batching.MaxWait must be between zero and one second (was {batching.MaxWait}).");
        }

        var outbox = options.Outbox;
        if (outbox.BatchSize is < 1 or > 10_000)
        {
            failures.Add($"Outbox.BatchSize must be between 1 and 10000 (was {outbox.BatchSize}).");
        }

        if (outbox.PollingInterval <= TimeSpan.Zero || outbox.PublishTimeout <= TimeSpan.Zero || outbox.InitialBackoff <= TimeSpan.Zero
            || outbox.MaxBackoff < outbox.InitialBackoff || outbox.DispatchedRetention <= TimeSpan.Zero)
        {
            failures.Add("Outbox intervals must be positive, and Outbox.MaxBackoff at least Outbox.InitialBackoff.");
        }

        var maintenance = options.Maintenance;
        if (maintenance.CleanupBatchSize is < 1 or > 100_000 || maintenance.CleanupInterval <= TimeSpan.Zero
            || maintenance.StatisticsInterval <= TimeSpan.Zero || maintenance.OutboxBacklogThreshold <= TimeSpan.Zero
            || maintenance.CleanupStaleThreshold <= TimeSpan.Zero)
        {
            failures.Add("Maintenance: CleanupBatchSize must be 1 to 100000 and every interval and threshold positive.");
        }

        var owners = new Dictionary<string, Type>(StringComparer.Ordinal);
        foreach (var (type, consumerName) in options.ConsumerNames)
        {
            try
            {
                ConsumerIdentities.Validate(type, consumerName);
            }
            catch (InvalidOperationException exception)
            {
                failures.Add(exception.Message);
                continue;
            }

            if (owners.TryGetValue(consumerName, out Type? other))
            {
                failures.Add($"Consumers '{other.FullName}' and '{type.FullName}' are both mapped to the inbox identity '{consumerName}'.");
            }
            else
            {
                owners.Add(consumerName, type);
            }
        }

        return failures.Count == 0 ? ValidateOptionsResult.Success : ValidateOptionsResult.Fail(failures);
    }
}
